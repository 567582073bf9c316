"""Sharded checkpoints (torch.distributed.checkpoint) that resume exactly, and Hugging Face export.

Layout of ``<root>/step_00000012/``: DCP shards of the model, AdamW state, LR schedule and the step
counters (every rank writes its own shards; no gather), ``rng_rank<r>.pt`` per rank, and
``trainer_state.json`` written last by rank 0. A checkpoint is written into ``*.partial`` and renamed
once every rank has finished, so a crash mid-save never leaves a directory that looks complete.
DCP reshards on load, so a checkpoint also loads into a different world size (RNG state then
restarts from the seed for the new ranks).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from services.trainer.spec import TrainerSpec

if TYPE_CHECKING:  # the trainer service lists checkpoints without importing torch; its ranks use it
    import torch


class TrainerRank(Protocol):
    """What a checkpoint reads from and restores into a trainer rank (implemented by
    services.trainer.worker.TrainerWorker, which imports this module, never the reverse)."""

    rank: int
    world_size: int
    step: int
    last_packer_step: int
    model: Any  # the FSDP-wrapped Qwen2ForCausalLM
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    spec: TrainerSpec | None

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor] | None: ...


STATE_FILE = "trainer_state.json"
PREFIX = "step_"


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith(PREFIX)
        and not p.name.endswith(".partial")
        and (p / STATE_FILE).exists()
    ]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_state(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / STATE_FILE).read_text())


def _optimizer(worker: TrainerRank) -> torch.optim.Optimizer:
    if worker.optimizer is None:
        raise RuntimeError(f"trainer rank {worker.rank} has no optimizer: it was never set up to train")
    return worker.optimizer


class _TrainState:
    """DCP Stateful view of a worker: model + optimizer via the distributed state-dict API."""

    def __init__(self, worker: TrainerRank) -> None:
        self.worker = worker

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        w = self.worker
        model_sd, optim_sd = get_state_dict(w.model, _optimizer(w))
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": w.scheduler.state_dict(),
            "step": w.step,
            "last_packer_step": w.last_packer_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        w = self.worker
        set_state_dict(
            w.model, _optimizer(w), model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        w.scheduler.load_state_dict(state["scheduler"])
        w.step = int(state["step"])
        w.last_packer_step = int(state["last_packer_step"])


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(worker: TrainerRank, root: str, extra: dict[str, Any], keep: int = 3) -> str:
    """Collective: write a checkpoint of the current step; returns its directory."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = checkpoint_dir(root, worker.step)
    staging = final.with_name(final.name + ".partial")
    if worker.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    dcp.save({"train": _TrainState(worker)}, checkpoint_id=str(staging))
    torch.save(_rng_state(), staging / f"rng_rank{worker.rank}.pt")
    dist.barrier()
    if worker.rank == 0:
        state = {
            "step": worker.step,
            "weight_version": worker.step,
            "last_packer_step": worker.last_packer_step,
            "world_size": worker.world_size,
            "saved_at": time.time(),
            "spec": worker.spec.to_dict() if worker.spec else {},
            "extra": extra,
        }
        (staging / STATE_FILE).write_text(json.dumps(state, indent=2, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return str(final)


def load(worker: TrainerRank, path: str) -> dict[str, Any]:
    """Collective: restore model, optimizer, schedule, counters and this rank's RNG from `path`."""
    import torch
    import torch.distributed.checkpoint as dcp

    path_obj = Path(path)
    state = read_state(path_obj)
    dcp.load({"train": _TrainState(worker)}, checkpoint_id=str(path_obj))
    rng_file = path_obj / f"rng_rank{worker.rank}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return state


def export_hf(worker: TrainerRank, directory: str, evaluated: Collection[int] = (), keep: int = 0) -> str:
    """Collective: gather the full state dict to rank 0 and write a complete HF directory there.

    Weights and config.json, the run's tokenizer files (copied from its tokenizer directory, or the
    char tokenizer written out as a PreTrainedTokenizerFast), generation_config.json and config.json
    with eos/pad/bos ids (so `generate()` stops where the policy stops), and a README.md model card
    naming the run, the step and the recipe. The one place the trainer gathers the whole model
    (export is rare and explicit). A LoRA run exports its adapter in PEFT's format
    (adapter_config.json, adapter_model.safetensors: what `peft.PeftModel.from_pretrained` and
    vLLM's LoRA loader read) with the tokenizer, and with `merge_on_export` the merged model in
    `merged/`.

    Written into `*.partial` and renamed, so a reader (`looprl eval`) never finds half an export.
    With `keep`, the exports beside it of `evaluated` steps are pruned to the newest `keep`.
    """
    import torch.distributed as dist

    from services.modeling import hf_files, lora
    from services.modeling.tokenizer import load_tokenizer

    full = worker.full_state_dict(rank0_only=True)
    if full is not None:  # rank 0's
        final = Path(directory)
        staging = final.with_name(final.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        spec = worker.spec
        tokenizer = spec.recipe.model.tokenizer if spec is not None else "char"
        section = spec.recipe.model.lora if spec is not None else None
        config = worker.model.config
        facts: dict[str, Any] = {}
        if section is None:
            parameters = _write_model(str(staging), config, full, tokenizer)
        else:
            adapter = {k: v for k, v in full.items() if lora.is_adapter_param(k)}
            base = {k: v for k, v in full.items() if not lora.is_adapter_param(k)}
            lora_spec = lora.spec_of(section)
            lora.save_peft(
                str(staging),
                adapter,
                lora_spec,
                base_model=spec.recipe.model.path if spec is not None else "",
                architecture=config.to_hf_dict().get("architectures", [""])[0],
            )
            hf_files.write_tokenizer_files(
                tokenizer, staging, model_max_length=config.max_position_embeddings
            )
            parameters = sum(t.numel() for t in base.values())
            facts["adapter"] = (
                f"LoRA rank {lora_spec.rank}, alpha {lora_spec.alpha:g}, on {', '.join(lora_spec.targets)}: "
                f"{sum(t.numel() for t in adapter.values()):,} parameters (PEFT format)"
            )
            if section.merge_on_export:
                merged = lora.merged_state_dict(base, adapter, lora_spec)
                _write_model(str(staging / "merged"), config, merged, tokenizer)
                facts["merged model"] = "merged/ (the adapter folded into the base)"
        ids = hf_files.special_ids(load_tokenizer(staging if section is None else tokenizer))
        run_id = spec.run_id if spec is not None else ""
        facts = {
            "run id": run_id or "(none)",
            "step": worker.step,
            "weight version": worker.step,
            "parameters": f"{parameters:,}",
            "base model": (
                spec.recipe.model.path
                if spec is not None and spec.recipe.model.path
                else "built from a config"
            ),
            **facts,
            "tokenizer": tokenizer,
            "eos / pad / bos ids": f"{ids['eos_token_id']} / {ids['pad_token_id']} / {ids['bos_token_id']}",
            "exported at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }
        hf_files.write_model_card(
            staging,
            title=f"looprl policy {run_id or 'export'} at step {worker.step}",
            facts=facts,
            recipe=spec.recipe.to_dict() if spec is not None else None,
            note=(
                "Trained with looprl (RL post-training). Load with transformers' AutoModelForCausalLM "
                "and AutoTokenizer; generation_config.json stops on the tokenizer's eos."
                if section is None
                else "A LoRA adapter trained with looprl (RL post-training). Load it on its base model "
                "with peft.PeftModel.from_pretrained, or serve it with vLLM's LoRA support."
            ),
        )
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        if keep > 0:
            prune_exports(final.parent, evaluated, keep)
    dist.barrier()
    return directory


def export_dir(root: Path, step: int) -> Path:
    """Where a run's Hugging Face export of `step` goes, under the run's checkpoint root."""
    return root / "hf" / f"step_{step:08d}"


def prune_exports(hf_root: Path, evaluated: Collection[int], keep: int) -> list[Path]:
    """Remove the exports in `hf_root` of `evaluated` steps but the newest `keep`; returns them.
    Exports of other steps (one asked for through TrainerService.Checkpoint) are left."""
    steps = sorted(
        int(p.name.removeprefix("step_"))
        for p in hf_root.glob("step_*")
        if p.name.removeprefix("step_").isdigit() and int(p.name.removeprefix("step_")) in evaluated
    )
    removed = [export_dir(hf_root.parent, step) for step in steps[: max(len(steps) - keep, 0)]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _write_model(directory: str, config: Any, state: dict[str, Any], tokenizer: str) -> int:
    """A complete HF model directory of `state`; returns its parameter count."""
    import torch

    from services.modeling import hf_files
    from services.modeling.causal_lm import causal_lm_class

    # The generic path's model is built for real: transformers computes buffers at init.
    with torch.device("cpu" if config.generic else "meta"):
        model = causal_lm_class(config)(config, seed=None)
    model.load_hf_state_dict(state, assign=not config.generic)
    model.save_pretrained(directory)
    hf_files.write_tokenizer_files(tokenizer, directory, model_max_length=config.max_position_embeddings)
    hf_files.write_generation_files(directory, tokenizer)
    return sum(p.numel() for p in model.parameters())
