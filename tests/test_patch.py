"""The adapters' one patch helper: idempotent, the original reachable, an exact undo."""

import types

from slipstream._common import patch as _patch


def test_patch_is_idempotent_keeps_the_original_and_undoes_exactly():
    module = types.SimpleNamespace(fn=lambda x: x)
    original = module.fn

    def replacement(x):
        return x + 1

    assert _patch.patch(module, "fn", replacement, owner="test")
    assert not _patch.patch(module, "fn", lambda x: x + 2, owner="test")  # already patched
    assert module.fn is replacement and module.fn.__wrapped__ is original and module.fn(1) == 2
    assert _patch.is_patched(module, "fn") and "test: SimpleNamespace.fn" in _patch.patches("test")
    assert _patch.unpatch(module, "fn") and module.fn is original
    assert not _patch.unpatch(module, "fn") and not _patch.is_patched(module, "fn")


def test_an_instance_patch_of_an_inherited_method_is_deleted_again():
    class Optimizer:
        def reduce(self):
            return "stock"

    opt = Optimizer()
    _patch.patch(opt, "reduce", lambda: "ours", owner="test")
    assert opt.reduce() == "ours" and Optimizer().reduce() == "stock"
    _patch.unpatch(opt, "reduce")
    assert "reduce" not in vars(opt) and opt.reduce() == "stock"


def test_uninstall_all_undoes_every_patch_of_an_owner_newest_first():
    a = types.SimpleNamespace(x=1)
    b = types.SimpleNamespace(y=2)
    _patch.patch(a, "x", types.SimpleNamespace(), owner="one")
    _patch.patch(b, "y", types.SimpleNamespace(), owner="two")
    _patch.uninstall_all("one")
    assert a.x == 1 and _patch.is_patched(b, "y")
    _patch.uninstall_all()
    assert b.y == 2 and _patch.patches() == []
