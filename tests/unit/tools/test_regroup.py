"""tools/regroup.py's rewrites, on small texts: every way a moved module or file is named comes out
naming the new one, and nothing else changes."""

from __future__ import annotations

from tools import regroup

MODULES = {
    "services.kit.tls": "services.kit.rpc.tls",
    "services.kit.config": "services.kit.config.service",
    "services.kit.bus": "services.kit.bus.client",
    "services.kit.bus_errors": "services.kit.bus.errors",
}
PATHS = {
    "services/kit/tls.py": "services/kit/rpc/tls.py",
    "services/kit/bus.py": "services/kit/bus/client.py",
    "services/kit/bus_errors.py": "services/kit/bus/errors.py",
    "services/kit/bus_errors\\.py": "services/kit/bus/errors\\.py",
}


def rewrite(text: str) -> str:
    text = regroup.rewrite_text(text, MODULES, PATHS)
    return regroup.rewrite_quoted_imports(regroup.rewrite_from_imports(text, MODULES), MODULES)


def test_imports_of_a_moved_module_name_the_new_one():
    before = (
        "from services.kit import tls, errors  # why\n"
        "from services.kit.bus import Bus\n"
        "from services.kit.bus_errors import BusError\n"
        "import services.kit.config as cfg\n"
        "def f():\n"
        "    from services.kit import config\n"
    )
    assert rewrite(before) == (
        "from services.kit import errors  # why\n"
        "from services.kit.rpc import tls\n"
        "from services.kit.bus.client import Bus\n"
        "from services.kit.bus.errors import BusError\n"
        "import services.kit.config.service as cfg\n"
        "def f():\n"
        "    from services.kit.config import service as config\n"
    )


def test_names_in_strings_docs_and_paths_follow_and_lookalikes_do_not():
    before = (
        'patch("services.kit.tls._stand_ins")\n'
        'code = "from services.kit import tls\\ntls.configure()"\n'
        "see services/kit/bus.py and ../services/kit/tls.py, `kit/bus_errors.py`\n"
        'match=r"not in services/kit/bus_errors\\.py"\n'
        "services.kit.tlsx services/kit/bus.pyc services.kit.config:ServiceConfig\n"
    )
    assert rewrite(before) == (
        'patch("services.kit.rpc.tls._stand_ins")\n'
        'code = "from services.kit.rpc import tls\\ntls.configure()"\n'
        "see services/kit/bus/client.py and ../services/kit/rpc/tls.py, `kit/bus/errors.py`\n"
        'match=r"not in services/kit/bus/errors\\.py"\n'
        "services.kit.tlsx services/kit/bus.pyc services.kit.config.service:ServiceConfig\n"
    )


def test_a_moved_file_climbs_as_many_more_folders_as_it_went_down():
    text = 'ROOT = Path(__file__).resolve().parents[2]\nHERE = Path(__file__).resolve().parent.parent / "x"\n'
    assert regroup.reanchor(text, 1) == (
        'ROOT = Path(__file__).resolve().parents[3]\nHERE = Path(__file__).resolve().parents[2] / "x"\n'
    )
    assert regroup.reanchor(text, 0) == text
