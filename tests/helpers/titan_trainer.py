"""torchtitan 0.3.0's own ``Trainer`` with a tiny Llama 3, synthetic tokens and no tokenizer.

What the tests need beside dmuon's integration: nothing can be downloaded here (no dataset, no
tokenizer files), so the Trainer gets a dataloader that draws deterministic random tokens per
(data-parallel rank, batch index) and a tokenizer that is never asked anything. Attention is
torch's SDPA (``is_causal``): torchtitan's language-model default, FlexAttention, is compiled
with inductor even when ``compile.enable`` is off, which costs minutes on two CPU cores.

``run(config, stop_after=k)`` trains like ``torchtitan.train.main`` does and returns the loss of
every step and the full weights at the end (gathered on every rank).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from tests.helpers import titan_cpu

titan_cpu.prepare()  # before the first torchtitan import that reaches models.common

import torch  # noqa: E402
from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: E402
from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import (  # noqa: E402
    LRSchedulersContainer,
    default_adamw,
    register_moe_load_balancing_hook,
)
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.config.configs import CommConfig, DebugConfig  # noqa: E402
from torchtitan.distributed.pipeline_parallel import pipeline_llm  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.config_utils import (  # noqa: E402
    make_ffn_config,
    make_gqa_config,
    make_moe_config,
    make_routed_experts_config,
    make_router_config,
)
from torchtitan.models.llama3 import Llama3Model, parallelize_llama  # noqa: E402
from torchtitan.models.llama3.model import Llama3TransformerBlock  # noqa: E402
from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3  # noqa: E402
from torchtitan.models.qwen3.model import Qwen3TransformerBlock  # noqa: E402
from torchtitan.protocols.model_spec import ModelSpec  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

VOCAB = 128
DIM = 64
HEADS = 4
LAYERS = 2
SEQ = 32


class SyntheticTokens(BaseDataLoader):
    """Sample ``i`` of data-parallel rank ``r`` is ``randint`` from a generator seeded by (seed, r, i).

    Per sample, not per batch: with pipeline stages the Trainer draws a step's batch as several
    microbatches, and rank ``r`` still sees the same token rows in the same order. The state is
    the number of samples served, the same on every rank and so under one key, which a job of
    another data-parallel degree can load too; a resumed run continues with the next sample.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = VOCAB
        seed: int = 1234

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int,
                 local_batch_size: int, **unused: Any) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.seq_len = seq_len
        self.batch_size = local_batch_size
        self.served = 0

    def __iter__(self):
        while True:
            rows = []
            for _ in range(self.batch_size):
                seed = self.config.seed * 1_000_003 + self.dp_rank * 10_007 + self.served
                gen = torch.Generator().manual_seed(seed)
                rows.append(torch.randint(0, self.config.vocab_size, (self.seq_len + 1,), generator=gen))
                self.served += 1
            tokens = torch.stack(rows)
            yield {"input": tokens[:, :-1]}, tokens[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"samples_served": self.served}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.served = state_dict.get("samples_served", 0)


class NoTokenizer(BaseTokenizer):
    """The Trainer builds a tokenizer for its dataloader and validator; ours need none."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str | None = None) -> None:
        super().__init__()

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("synthetic data has no text")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("synthetic data has no text")

    def get_vocab_size(self) -> int:
        return VOCAB


def _whole(init):
    """``init`` drawn for the whole parameter, of which each rank keeps its own shard.

    Why: DTensor has no random-number tracker on the CPU (torch's offset-based one is for
    CUDA-like devices), so a random init of a sharded parameter draws the same values into every
    shard. An FSDP-sharded matrix would repeat its first rows, and expert ``i`` of an expert stack
    would equal expert ``i + E/shards``, which hides any mix-up of experts between ranks.
    torchtitan seeds every rank of an SPMD group alike, so each draws the same whole tensor.
    """

    def apply(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, DTensor):
            return init(tensor)
        whole = init(torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.to_local().device))
        mine = distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None)
        with torch.no_grad():
            tensor.to_local().copy_(mine.to_local())
        return tensor

    return apply


def _normal(std: float):
    return _whole(functools.partial(torch.nn.init.trunc_normal_, std=std))


def tiny_llama3(layers: int = LAYERS) -> Llama3Model.Config:
    """Llama 3 with dim 64, ``layers`` blocks (2), 4 heads, vocabulary 128; torchtitan's own blocks."""
    linear = {"weight": _normal(0.02), "bias": torch.nn.init.zeros_}
    norm = {"weight": torch.nn.init.ones_}
    rope = ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=10000.0)
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
            ffn_norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
            attention=make_gqa_config(dim=DIM, n_heads=HEADS, wqkv_param_init=linear, wo_param_init=linear,
                                      inner_attention=ScaledDotProductAttention.Config(), rope=rope),
            feed_forward=make_ffn_config(dim=DIM, hidden_dim=4 * DIM, w1_param_init=linear,
                                         w2w3_param_init=linear),
        )
        for _ in range(layers)
    ]
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": _whole(torch.nn.init.normal_)}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=linear),
        layers=layers,
    )


def tiny_qwen3_moe(num_experts: int = 8, top_k: int = 2, layers: int = LAYERS) -> Qwen3Model.Config:
    """Qwen3 MoE with dim 64, ``layers`` blocks (2), 4 heads, ``num_experts`` routed experts of hidden size 32.

    The experts of each block are one ``GroupedExperts`` with 3-D stacks ``w1_EFD [E, 32, 64]``,
    ``w2_EDF [E, 64, 32]``, ``w3_EFD [E, 32, 64]``; tokens reach them through the all-to-all
    dispatcher (``comm_backend="standard"``), which with EP 1 reorders locally.
    """
    linear = {"weight": _normal(0.02), "bias": torch.nn.init.zeros_}
    norm = {"weight": torch.nn.init.ones_}
    experts = {name: _normal(0.02) for name in ("w1_EFD", "w2_EDF", "w3_EFD")}
    rope = ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=10000.0)
    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
            ffn_norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
            # head_dim explicit: Qwen3's FLOP count reads it
            attention=make_gqa_config(dim=DIM, n_heads=HEADS, head_dim=DIM // HEADS, wqkv_param_init=linear,
                                      wo_param_init=linear, inner_attention=ScaledDotProductAttention.Config(),
                                      rope=rope),
            moe=make_moe_config(
                num_experts=num_experts,
                router=make_router_config(dim=DIM, num_experts=num_experts, gate_param_init=linear, top_k=top_k,
                                          score_func="softmax", route_norm=True),
                routed_experts=make_routed_experts_config(dim=DIM, hidden_dim=DIM // 2, num_experts=num_experts,
                                                          top_k=top_k, param_init=experts,
                                                          comm_backend="standard"),
            ),
        )
        for _ in range(layers)
    ]
    return Qwen3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={"weight": _whole(torch.nn.init.normal_)}),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=norm),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=linear),
        layers=layers,
    )


def tiny_model_spec(model: str = "llama3", *, num_experts: int = 8, layers: int = LAYERS) -> ModelSpec:
    """``model``: "llama3" (dense) or "moe" (Qwen3 MoE with ``num_experts`` experts per block)."""
    pipelining = titan_cpu.presplit_pipelining(pipeline_llm)
    if model == "llama3":
        return ModelSpec(name="llama3", flavor="tiny", model=tiny_llama3(layers),
                         parallelize_fn=titan_cpu.gloo_parallelize(parallelize_llama), pipelining_fn=pipelining,
                         post_optimizer_build_fn=None, state_dict_adapter=None)
    return ModelSpec(name="qwen3", flavor="tiny-moe", model=tiny_qwen3_moe(num_experts, layers=layers),
                     parallelize_fn=titan_cpu.gloo_parallelize(parallelize_qwen3), pipelining_fn=pipelining,
                     post_optimizer_build_fn=register_moe_load_balancing_hook, state_dict_adapter=None)


def tiny_config(folder: str, *, steps: int = 6, interval: int = 3, async_mode: str = "disabled",
                compile: bool = False, backend: str = "aot_eager", muon: bool = True, model: str = "llama3",
                num_experts: int = 8, layers: int = LAYERS, **parallelism: Any) -> Trainer.Config:
    """A full Trainer.Config: FSDP over all ranks, fp32, checkpoints every ``interval`` steps.

    ``muon``: through ``dmuon.integrations.torchtitan.with_dmuon``, as a user's config does;
    otherwise torchtitan's AdamW. ``model``, ``num_experts``, ``layers``: see :func:`tiny_model_spec`.
    ``parallelism``: fields of torchtitan's ``ParallelismConfig`` (``expert_parallel_degree=2``...).
    """
    config = Trainer.Config(
        model_spec=tiny_model_spec(model, num_experts=num_experts, layers=layers),
        hf_assets_path="",
        dump_folder=folder,
        tokenizer=NoTokenizer.Config(),
        dataloader=SyntheticTokens.Config(),
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        optimizer=default_adamw(lr=1e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5, min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=2, seq_len=SEQ, steps=steps, mixed_precision_param="float32",
                                disable_cuda_graphs=True),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor", **parallelism),
        checkpoint=CheckpointManager.Config(enable=True, folder="checkpoint", interval=interval,
                                            async_mode=async_mode, last_save_model_only=False),
        activation_checkpoint=None,  # type: ignore[arg-type]
        compile=CompileConfig(enable=compile, components=["model"], backend=backend),
        metrics=MetricsProcessor.Config(log_freq=1),
        comm=CommConfig(trace_buf_size=0),
        debug=DebugConfig(seed=0, enable_structured_logging=False),
    )
    if muon:
        from dmuon.integrations.torchtitan import with_dmuon

        config = with_dmuon(config, lr=0.02, adamw_lr=1e-3)
    return config


def run(config: Trainer.Config, *, stop_after: int | None = None, initial: bool = False,
        optimizer_state: bool = False) -> dict[str, Any]:
    """Build the Trainer from ``config``, train (until step ``stop_after``), close it.

    ``stop_after`` ends the loop early as a preempted job would, with the schedule of the full
    run. Returns ``{"losses": {step: loss}, "weights": {fqn: full fp32 tensor}, "step": last,
    "dedicated": [fqn, ...], "matrices": [fqn of a sharded matrix (TP), ...], "optimizer": container class
    name, "parts": model parts here, "layouts": {fqn: (mesh dim names, placements, local shape)} of this
    rank's parameters}``;
    with ``initial``, also ``"initial"``: the weights as built, before training or loading;
    with ``optimizer_state``, also ``"optimizer_state"``: the container's flat state dict whole.
    A rank without the last pipeline stage logs a loss of -1 (torchtitan's placeholder) summed
    over its data-parallel ranks.
    """
    from dmuon.dedicated import get_registry

    trainer = config.build()
    losses: dict[int, float] = {}
    log = trainer.metrics_processor.log

    def record(step, global_avg_loss, *args, **kwargs):
        losses[step] = global_avg_loss
        return log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = record
    if stop_after is not None:
        trainer.should_continue_training = lambda: trainer.step < stop_after
    out: dict[str, Any] = {}
    try:
        if initial:
            out["initial"] = full_weights(trainer.model_parts)
        trainer.train()
        out["weights"] = full_weights(trainer.model_parts)
        if optimizer_state:
            out["optimizer_state"] = full_optimizer_state(trainer.optimizers)
    finally:
        trainer.close()
    dedicated = [rec.fqn for part in trainer.model_parts for rec in get_registry(part) or ()]
    matrices = [fqn for part in trainer.model_parts for fqn in getattr(get_registry(part), "matrix_fqns", ())]
    layouts = {fqn: (p.device_mesh.mesh_dim_names, tuple(p.placements), tuple(p.to_local().shape))
               for part in trainer.model_parts for fqn, p in part.named_parameters() if isinstance(p, DTensor)}
    return {**out, "losses": losses, "step": trainer.step, "dedicated": sorted(dedicated),
            "matrices": sorted(matrices), "optimizer": type(trainer.optimizers).__name__,
            "parts": len(trainer.model_parts), "layouts": layouts}


def full_weights(model_parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Every weight of every part whole on every rank, through torch's full state dict (dmuon-aware).

    Each part is gathered over its own data-parallel ranks; with pipeline stages the parts of
    other ranks come from :func:`_merge_ranks`.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    mine: dict[str, torch.Tensor] = {}
    for part in model_parts:
        mine.update({k: v.detach().clone() for k, v in get_model_state_dict(part, options=options).items()})
    return _merge_ranks(mine)


def full_optimizer_state(optimizers) -> dict[str, Any]:
    """The optimizer container's flat state dict (``state.{fqn}.{name}``...) whole on every rank.

    A DTensor is gathered over its own mesh; every rank of a mesh holds the same keys, and
    sorting them makes the gathers meet in the same order.
    """
    flat = optimizers.state_dict()
    mine: dict[str, Any] = {}
    for key in sorted(flat):
        value = flat[key]
        if isinstance(value, DTensor):
            value = value.full_tensor()
        mine[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return _merge_ranks(mine)


def _merge_ranks(mine: dict[str, Any]) -> dict[str, Any]:
    """The union of every rank's ``mine`` (all-gathered): with pipeline stages each rank holds
    some parts. A key two ranks hold must have equal values."""
    import torch.distributed as dist

    everyone: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    merged: dict[str, Any] = {}
    for state in everyone:
        for key, value in state.items():
            if key in merged:
                same = torch.equal(merged[key], value) if isinstance(value, torch.Tensor) else merged[key] == value
                assert same, f"ranks disagree on {key}"
            merged.setdefault(key, value)
    return merged
