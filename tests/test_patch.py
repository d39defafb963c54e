"""The adapters' one patch helper: idempotent, the original reachable, an exact undo."""

import gc
import types
import weakref

import torch

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


def test_a_change_is_undone_with_the_rest_and_leaves_with_its_target():
    class Model:
        pass

    model, undone = Model(), []
    assert _patch.change(("test", id(model)), "Model: changed", lambda: undone.append(1), owner="test", target=model)
    assert not _patch.change(("test", id(model)), "again", lambda: undone.append(2), owner="test")  # first stays
    assert "test: Model: changed" in _patch.patches("test")
    _patch.uninstall_all("test")
    assert undone == [1] and _patch.patches("test") == []
    _patch.change(("test", id(model)), "Model: changed", lambda: undone.append(3), owner="test", target=model)
    del model
    gc.collect()
    assert _patch.patches("test") == [] and undone == [1]  # gone with its target, not undone


def test_an_instance_patch_does_not_keep_the_instance_alive():
    class Layer:
        def forward(self):
            return "stock"

    layer = Layer()
    _patch.patch(layer, "forward", types.MethodType(lambda self: "ours", layer), owner="test")
    alive = weakref.ref(layer)
    del layer
    gc.collect()
    assert alive() is None and _patch.patches("test") == []


def test_disable_undoes_a_compiled_models_forward_and_status_lists_it():
    import slipstream
    from slipstream.core_compile.autotune.api import is_compiled

    model = torch.nn.Linear(4, 4)
    slipstream.compile(model, config=slipstream.CompileConfig(strategy="eager", verbose=False))
    assert is_compiled(model) and any(p.startswith("compile: Linear.forward") for p in slipstream.status()["patches"])
    slipstream.disable()
    assert not is_compiled(model) and "forward" not in vars(model)
    assert torch.equal(model(torch.ones(4)), torch.nn.functional.linear(torch.ones(4), model.weight, model.bias))


def test_compile_stacks_over_the_varlen_pass_and_disable_undoes_both_newest_first():
    import slipstream
    from slipstream.core_compile import apply_varlen, is_varlen_patched
    from slipstream.core_compile.autotune.api import is_compiled
    from slipstream.recipes.model import build_model

    model = build_model("llama-tiny", vocab_size=128, seed=0)
    stock_forward = model.forward
    apply_varlen(model)
    slipstream.compile(model, config=slipstream.CompileConfig(strategy="eager", verbose=False))
    assert is_varlen_patched(model) and is_compiled(model) and slipstream.compile_report(model) is not None
    owners = [p.split(":")[0] for p in slipstream.status()["patches"]]
    assert "varlen" in owners and "compile" in owners
    slipstream.disable()
    assert not is_compiled(model) and not is_varlen_patched(model) and "forward" not in vars(model)
    assert model.forward == stock_forward and model.config._attn_implementation != "slipstream_varlen"
