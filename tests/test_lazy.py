"""The one lazy loader (``_common/lazy.py``): names load on first use, a same-named submodule is
the module, a function builds its value once, a missing framework names its extra. Pure logic."""

import sys
import types

import pytest

from slipstream._common import lazy


@pytest.fixture
def package(monkeypatch):
    """A package ``lazy_pkg`` over the real ``json`` modules, so targets resolve to known objects."""
    mod = types.ModuleType("lazy_pkg")
    mod.__path__ = []
    monkeypatch.setitem(sys.modules, "lazy_pkg", mod)
    return mod


def test_names_load_on_first_use_and_are_cached(package):
    built = []
    package.__getattr__, package.__dir__ = lazy.attributes("lazy_pkg", {
        "dumps": "json", "decoder": "json:decoder", "parse": "json.decoder:JSONDecoder",
        "made": lambda: built.append(1) or len(built)})
    import json
    import json.decoder

    assert package.dumps is json.dumps and package.decoder is json.decoder
    assert package.parse is json.decoder.JSONDecoder
    assert (package.made, package.made, built) == (1, 1, [1])  # built once, then a plain attribute
    assert {"dumps", "made", "parse"} <= set(dir(package))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        package.nope


def test_a_submodule_of_the_same_name_is_the_module_and_a_deeper_one_gives_its_attribute():
    import slipstream
    import slipstream.core_comm as core_comm
    from slipstream.core_comm import backend

    assert core_comm.pool is sys.modules["slipstream.core_comm.pool"]
    assert callable(slipstream.ddp_hook) and slipstream.ddp_hook is backend.ddp_hook.ddp_hook


def test_a_missing_framework_names_the_extra_to_install(package):
    package.__getattr__, _ = lazy.attributes("lazy_pkg", {"x": "json"}, requires=("no_such_framework", "stack"))
    with pytest.raises(ImportError, match=r'pip install "slipstream\[stack\]"'):
        package.x
