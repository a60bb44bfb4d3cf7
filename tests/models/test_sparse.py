from __future__ import annotations

import torch

from loka_trainer.models.sparse import SparseArch, build_ebc, build_ec, left_pad_jagged


def _reference_left_pad(values, lengths, max_length):
    rows, masks, start = [], [], 0
    for n in lengths.tolist():
        row = values[start : start + n][-max_length:] if n else values[:0]
        pad = max_length - row.shape[0]
        rows.append(torch.cat([values.new_zeros(pad, values.shape[1]), row]))
        masks.append(torch.tensor([False] * pad + [True] * row.shape[0]))
        start += n
    return torch.stack(rows), torch.stack(masks)


def test_left_pad_puts_newest_last_and_truncates_oldest():
    lengths = torch.tensor([0, 3, 7, 5, 1])
    values = torch.randn(int(lengths.sum()), 4)
    padded, mask = left_pad_jagged(values, lengths, 5)
    expected, expected_mask = _reference_left_pad(values, lengths, 5)
    torch.testing.assert_close(padded, expected)
    assert torch.equal(mask, expected_mask)
    torch.testing.assert_close(padded[2, -1], values[3 + 7 - 1])  # newest id of row 2


def test_left_pad_handles_all_empty_rows_and_passes_gradients():
    padded, mask = left_pad_jagged(torch.zeros(0, 3), torch.tensor([0, 0]), 4)
    assert padded.shape == (2, 4, 3) and not mask.any()
    values = torch.randn(6, 3, requires_grad=True)
    padded, _ = left_pad_jagged(values, torch.tensor([2, 4]), 3)
    padded.sum().backward()
    assert values.grad[0].abs().sum() > 0 and values.grad[2].abs().sum() == 0  # truncated oldest id of row 1


def test_sparse_arch_pools_in_schema_order(make_schema, make_batch):
    schema = make_schema(num_sparse=3, vocab=10, num_seq=1)
    batch = make_batch(schema, 4, multi_hot=1)
    arch = SparseArch(build_ebc(schema, 6), build_ec(schema, 6))
    pooled = arch(batch.sparse)
    assert pooled.shape == (4, 3, 6)
    table = arch.ebc.embedding_bags["t_c1"].weight
    ids = batch.sparse["c1"].values()
    torch.testing.assert_close(pooled[:, 1], table[ids])
    (values, lengths), = arch.sequences(batch.sequences).values()
    assert values.shape == (int(lengths.sum()), 6)
