"""What a cache needs to know about transformers' tensor parallelism (docs/distributed.md).

Under `from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))` each rank computes a contiguous
shard of the KV heads: rank r of N holds global heads `[r * H / N, (r + 1) * H / N)`. Our layers read their (local)
head count from the keys they receive, so almost nothing needs to know about it. Three things do, because they are
defined over the model's global heads:
- per-head data computed elsewhere, e.g. calibrated FP8 scales for all heads: sliced to the rank's heads;
- random draws per head (RandomEvictionCache): keyed by the global head index, so every rank makes the draws one
  process makes for those heads;
- statistics over all heads (FP8 `granularity="tensor"` warm-up scale): reduced over the TP group.

`TensorParallel.of(model)` reads the rank and group from the model (`model._tp_size`, `model._device_mesh["tp"]`,
set by transformers when it shards); a cache built from a config alone, or a model that is not sharded, gets the
single-process default (offset 0, no collective). Models whose plan replicates attention (Phi-3 gathers its fused
qkv output) give every rank all heads: `head_offset` is then 0 and nothing is reduced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..integration.models import tensor_parallel_mesh, tensor_parallel_size
from .architecture import kv_head_count


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0  # this process's rank in the TP group
    size: int = 1  # ranks in the TP group
    group: Any = None  # the TP process group (None: the default group)
    kv_heads: int | None = None  # the model's KV heads over all ranks (from its config)

    @classmethod
    def of(cls, config_or_model) -> TensorParallel:
        """The TP facts of a model (single-process default for a config or a model that is not sharded)."""
        size = tensor_parallel_size(config_or_model)
        if size <= 1 or not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return cls()
        mesh = tensor_parallel_mesh(config_or_model)
        if mesh is not None:
            rank, group = mesh.get_local_rank(), mesh.get_group()
        else:  # sharded without a mesh recorded: the default group is the TP group
            rank, group = torch.distributed.get_rank(), None
        config = config_or_model.config.get_text_config(decoder=True)
        return cls(rank=rank, size=size, group=group, kv_heads=kv_head_count(config))

    def sharded(self, local_heads: int) -> bool:
        """Whether a layer holding `local_heads` KV heads holds only a shard of the model's heads."""
        return self.size > 1 and (self.kv_heads is None or local_heads < self.kv_heads)

    def head_offset(self, local_heads: int) -> int:
        """Global index of this rank's first KV head, for a layer holding `local_heads` of them (0 unsharded)."""
        if not self.sharded(local_heads):
            return 0
        if self.kv_heads is not None and local_heads * self.size != self.kv_heads:
            raise ValueError(
                f"Tensor parallelism over {self.size} ranks gives this rank {local_heads} of the model's "
                f"{self.kv_heads} KV heads: `tp_size` must divide `num_key_value_heads` for hf_kvcache caches."
            )
        return self.rank * local_heads

    def all_reduce_max(self, tensor: torch.Tensor, local_heads: int) -> torch.Tensor:
        """`tensor` reduced in place to its maximum over the TP group when the layer's heads are sharded (a
        statistic over all heads); unchanged otherwise. Every rank must call it at the same point (collective)."""
        if self.sharded(local_heads):
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return tensor


SINGLE_PROCESS = TensorParallel()
