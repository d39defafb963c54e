"""The varlen pass's flash-attn backend against the padded model (GPU machines with flash-attn
only): bf16 loss and gradients, on a grouped-query model and on a sliding-window one."""

import copy

import pytest
import torch

from _varlen_ref import VOCAB, grads, padded
from slipstream.core_compile import VarlenConfig, apply_varlen
from slipstream.recipes.model import build_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["llama-tiny", "mistral-tiny"])  # grouped-query; and a sliding window
def test_flash_backend_matches_padded_sdpa_in_bf16(name):
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    ref = build_model(name, vocab_size=VOCAB, seed=1).cuda().to(torch.bfloat16)
    ours = apply_varlen(copy.deepcopy(ref), VarlenConfig(backend="flash"))
    ids, mask, labels = (t.cuda() for t in padded([30, 5, 17, 1]))  # 30 > the window of 16
    a = ours(input_ids=ids, attention_mask=mask, labels=labels)
    b = ref(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(a.loss, b.loss, rtol=2e-2, atol=2e-2)
    a.loss.backward()
    b.loss.backward()
    ref_grads = grads(ref)
    for n, g in grads(ours).items():
        torch.testing.assert_close(g.float(), ref_grads[n].float(), rtol=5e-2, atol=5e-2, msg=lambda m: f"{n}: {m}")
