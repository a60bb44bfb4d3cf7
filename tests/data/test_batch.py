"""Batch.to: the KJTs arrive with their per-key lengths counted on the host, so that TorchRec's input distribution
does not copy them back from the device (a host sync every step)."""
from __future__ import annotations

import pytest
import torch

from loka_trainer.data import DataConfig, build_stream


def test_moved_batches_carry_host_key_lengths(monkeypatch):
    batch = next(build_stream(DataConfig(batch_size=16, max_vocab_size=1_000, num_sequences=1, max_sequence_length=4,
                                         prefetch=0), split="train", rank=0, world_size=1))
    moved = batch.to("cpu")

    def no_device_to_host(tensor):  # what a KJT on the GPU would pay to count its keys' lengths
        raise AssertionError("per-key lengths counted after the move")

    monkeypatch.setattr(torch.Tensor, "tolist", no_device_to_host)
    for kjt, source in ((moved.sparse, batch.sparse), (moved.sequences, batch.sequences)):
        assert kjt.length_per_key() == [int(n) for n in source.lengths().view(len(source.keys()), -1).sum(1)]
        assert kjt.offset_per_key()[-1] == kjt.values().numel()
        kjt.permute(list(reversed(range(len(kjt.keys())))))  # what the sharded input distribution does first
    with pytest.raises(AssertionError):
        type(batch.sparse)(keys=["a"], values=torch.arange(3), lengths=torch.tensor([1, 2])).length_per_key()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_batch_on_the_gpu_distributes_its_keys_without_a_host_sync():
    batch = next(build_stream(DataConfig(batch_size=64, max_vocab_size=1_000, prefetch=0), split="train", rank=0,
                              world_size=1))
    moved = batch.to("cuda")
    order = list(reversed(range(len(moved.sparse.keys()))))
    order_tensor = torch.tensor(order, dtype=torch.int, device="cuda")  # a buffer of TorchRec's sharded module
    torch.cuda.set_sync_debug_mode("error")
    try:
        lengths = moved.sparse.length_per_key()
        moved.sparse.permute(order, order_tensor)  # what its input distribution does first
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum(lengths) == moved.sparse.values().numel()
