"""The padded model as the varlen pass's reference: batches and the step comparison."""

from __future__ import annotations

import torch

VOCAB = 97


def padded(lengths, seed=0, vocab=VOCAB):
    """A right-padded batch of ``lengths`` (pad id 0): ids, attention mask, labels (-100 at padding)."""
    gen = torch.Generator().manual_seed(seed)
    batch, seq = len(lengths), max(lengths)
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    mask = (torch.arange(seq).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    ids = ids * mask  # pad id 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_step_matches_padded(ref, ours, lengths, seed=0):
    """One forward and backward of both models on the same padded batch: ``ours`` (packed
    logits) has the loss, the real tokens' logits and the gradients of ``ref``."""
    ids, mask, labels = padded(lengths, seed)
    for m in (ref, ours):
        m.zero_grad(set_to_none=True)
    out_ref = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out_ref.loss.backward()
    out = ours(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    torch.testing.assert_close(out.loss, out_ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logits[0], out_ref.logits[mask.bool()], rtol=1e-4, atol=1e-5)
    ref_grads = grads(ref)
    for n, g in grads(ours).items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
