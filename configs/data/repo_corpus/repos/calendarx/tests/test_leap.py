from calendarx.leap import days_in_month, is_leap_year


def test_ordinary_leap_years():
    assert is_leap_year(2024) and not is_leap_year(2023)


def test_days_in_month():
    assert days_in_month(2024, 2) == 29 and days_in_month(2023, 4) == 30
