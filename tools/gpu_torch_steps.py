"""tools/gpu_torch_check.py's model sections: the models measured, parity of forward, log-probs and
one training step against float32 on the CPU, and the training step's tokens/s."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def model_configs() -> dict[str, Any]:
    """The models measured: the 10M recipe's shape and Qwen2.5-0.5B's (positions for 4k prompts)."""
    from services.modeling.config import ModelConfig

    return {
        "qwen2-10m": ModelConfig.tiny(
            vocab_size=1024,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            max_position_embeddings=8192,
        ),
        "qwen2.5-0.5b": ModelConfig(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
            tie_word_embeddings=True,
        ),
    }


def synchronize(device: str) -> Callable[[], None] | None:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.synchronize


def _packed(config: Any, lengths: list[int], seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, config.vocab_size, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return ids, positions, cu


def _micro_batch(config: Any, lengths: list[int], prompt: int, seed: int):
    import torch

    from services.trainer.batch import PackedMicroBatch

    ids, positions, cu = _packed(config, lengths, seed)
    mask = torch.zeros(len(ids))
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        mask[start + prompt : end] = 1.0
    g = torch.Generator().manual_seed(seed + 1)
    advantages = torch.randn(len(ids), generator=g) * mask
    behaviour = -torch.rand(len(ids), generator=g) * mask
    return PackedMicroBatch(
        step=0,
        input_ids=ids,
        position_ids=positions,
        cu_seqlens=cu,
        loss_mask=mask,
        advantages=advantages,
        behaviour_logprobs=behaviour,
        versions=torch.zeros(len(ids), dtype=torch.long),
        global_loss_tokens=int(mask.sum()),
        global_sequences=len(lengths),
    )


def _loss_settings() -> Any:
    """The recipe's default [algorithm] section; its plain values when pydantic is not installed."""
    from services.trainer.step import StepSettings

    try:
        from services.kit.config.recipe import AlgorithmSection

        loss: Any = AlgorithmSection()
    except ImportError:
        from types import SimpleNamespace

        loss = SimpleNamespace(
            advantage="grpo",
            filter_equal_rewards=False,
            loss_aggregation="token-mean",
            clip_low=0.2,
            clip_high=0.28,
            tis_cap=2.0,
            kl_coef=0.0,
            entropy_coef=0.0,
            group_timeout_seconds=120.0,
        )
    return StepSettings(loss=loss)


def _optimizer(model: Any, lr: float) -> tuple[Any, Any]:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def _train_once(
    model: Any, mb: Any, lr: float = 1e-3, optimizer: tuple[Any, Any] | None = None
) -> tuple[float, float]:
    """One step of the trainer's own code (accumulate, clip, AdamW); (loss, grad norm)."""
    from services.trainer.step import accumulate, apply_gradients

    opt, scheduler = optimizer or _optimizer(model, lr)
    sums = accumulate(model, [mb], _loss_settings(), trainer_version=0)
    norm, _, _ = apply_gradients(model, opt, scheduler, grad_clip=1.0)
    return float(sums.metrics.sums["loss"]), norm


def section_parity(device: str, cpu_mode: bool) -> dict[str, Any]:
    import torch

    from services.modeling.logprobs import token_logprobs
    from services.modeling.qwen2 import Qwen2ForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    configs = model_configs()
    names = ["qwen2-10m"] if cpu_mode else list(configs)
    results: dict[str, Any] = {}
    bounds = {"float32": 2e-3, "bfloat16": 0.15}  # max |log-prob difference| allowed, nats
    failed = []
    for name in names:
        config = configs[name]
        ref = Qwen2ForCausalLM(config, seed=None)
        ref.init_weights(0, std=0.02)
        ids, positions, cu = _packed(config, [17, 64, 130], seed=1)
        with torch.no_grad():
            ref_logits = ref(ids, positions, cu)
            ref_lp = token_logprobs(ref_logits, ids, cu)
        train_ref = None
        if name == "qwen2-10m":
            mb = _micro_batch(config, [48, 80, 96], prompt=32, seed=2)
            train_model = Qwen2ForCausalLM(config, seed=None)
            train_model.load_state_dict(ref.state_dict())
            train_ref = (
                _train_once(train_model, mb),
                {k: v.detach().clone() for k, v in train_model.state_dict().items()},
            )
        for dtype_name in ("float32", "bfloat16"):
            dtype = getattr(torch, dtype_name)
            model = Qwen2ForCausalLM(config, seed=None)
            model.load_state_dict(ref.state_dict())
            model = model.to(device=device, dtype=dtype)
            with torch.no_grad():
                logits = model(ids.to(device), positions.to(device), cu.to(device)).float().cpu()
                lp = token_logprobs(logits, ids, cu)
            row = {
                "logits_max_abs_diff": float((logits - ref_logits).abs().max()),
                "logprob_max_abs_diff": float((lp - ref_lp).abs().max()),
                "logprob_mean_abs_diff": float((lp - ref_lp).abs().mean()),
            }
            if train_ref is not None:
                (ref_loss, ref_norm), ref_weights = train_ref
                (loss, norm) = _train_once(model, mb.to(device))
                moved = max(
                    float((v.float().cpu() - ref_weights[k]).abs().max())
                    for k, v in model.state_dict().items()
                )
                row.update(
                    loss=loss,
                    loss_cpu=ref_loss,
                    grad_norm=norm,
                    grad_norm_cpu=ref_norm,
                    weights_max_abs_diff=moved,
                )
            ok = row["logprob_max_abs_diff"] <= bounds[dtype_name]
            row["ok"] = ok
            if not ok:
                failed.append(f"{name} {dtype_name}")
            results[f"{name}/{dtype_name}"] = row
            print(
                f"   {name:<13} {dtype_name:<9} "
                + ", ".join(f"{k} {v:.3g}" for k, v in row.items() if k != "ok")
            )
    out: dict[str, Any] = {"device": device, "results": results, "bounds_logprob_max_abs_diff": bounds}
    if failed:
        out.update(status="failed", why=f"log-probs off beyond the bound: {', '.join(failed)}")
    return out


def section_train(device: str, cpu_mode: bool) -> dict[str, Any]:
    import torch

    from services.modeling.qwen2 import Qwen2ForCausalLM

    configs = model_configs()
    shapes = (
        {"qwen2-10m": ([64] * 4, 16)}
        if cpu_mode
        else {"qwen2-10m": ([1024] * 8, 256), "qwen2.5-0.5b": ([1024] * 8, 256)}
    )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    results = {}
    for name, (lengths, prompt) in shapes.items():
        model = Qwen2ForCausalLM(configs[name], seed=None)
        model.init_weights(0, std=0.02)
        model = model.to(device=device, dtype=dtype)
        mb = _micro_batch(configs[name], lengths, prompt, seed=3).to(device)
        sync = synchronize(device) or (lambda: None)
        optimizer = _optimizer(model, 1e-6)
        _train_once(model, mb, optimizer=optimizer)  # warm-up (kernels, allocator, AdamW state)
        sync()
        times = []
        for _ in range(3):
            started = time.perf_counter()
            _train_once(model, mb, optimizer=optimizer)
            sync()
            times.append(time.perf_counter() - started)
        tokens = sum(lengths)
        best = min(times)
        results[name] = {
            "tokens": tokens,
            "tokens_per_s": tokens / best,
            "seconds": best,
            "dtype": str(dtype),
        }
        print(f"   {name:<13} {tokens} tokens/step: {tokens / best:,.0f} tokens/s ({best * 1e3:.1f} ms)")
        del model
    return {"train": results}
