from thermo.convert import c_to_f, c_to_k


def test_c_to_f():
    assert c_to_f(100) == 212


def test_c_to_k():
    assert c_to_k(0) == 273.15
