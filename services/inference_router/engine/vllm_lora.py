"""LoRA on vLLM: each run's adapter versions served as vLLM LoRA adapters, loaded by name.

A vLLM replica of a deployment with `max_loras` > 0 starts with `enable_lora` (engine/vllm_args.py)
and its base from `model_path`. Each adapter version a run commits here is written as a PEFT
directory (services/modeling/lora.save_peft: what vLLM's LoRA loader reads) and becomes a
`LoRARequest` named `<run>@<version>` with an id of its own, so vLLM loads it as a new adapter
(never a stale cached one); the run's next requests carry it. Requests in flight keep the
adapter they started with, so every token of a completion is sampled at one adapter version.
The directory of the version before the current one is kept for them; older ones are removed.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from services.inference_router.engine.vllm_args import lora_request_args
from services.kit.rpc.errors import FailedPrecondition
from services.modeling.config import ModelConfig


def vllm_lora_request(**kwargs: Any) -> Any:
    """vLLM's LoRARequest (a seam: CPU tests build it from the pinned sources)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(**kwargs)


class VLLMAdapters:
    """The adapters a vLLM engine serves, by run: the LoRARequest of each run's current version."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.versions: dict[str, int] = {}
        self._requests: dict[str, Any] = {}
        self._dirs: dict[str, list[Path]] = {}
        self._ids = itertools.count(1)

    def request_of(self, name: str) -> tuple[Any, int]:
        """(LoRARequest, version) a request of adapter `name` runs with."""
        if name not in self._requests:
            # Not the adapters it does serve: on a shared replica they are other tenants' runs.
            raise FailedPrecondition(f"adapter: {name!r} is not served here")
        return self._requests[name], self.versions[name]

    def install(
        self,
        name: str,
        version: int,
        config: ModelConfig,
        state: Mapping[str, torch.Tensor],
        backwards: bool = False,
    ) -> None:
        """Write version `version` of adapter `name` and serve it to the run's next requests."""
        from services.modeling.lora import save_peft

        if config.lora is None:
            raise ValueError(f"adapter {name!r}: its config is not a LoRA adapter")
        if version < self.versions.get(name, -1) and not backwards:
            raise FailedPrecondition(
                f"version: {version} is older than adapter {name!r}'s serving version {self.versions[name]}"
            )
        directory = self.root / name.replace("/", "_") / f"v{version}-{next(self._ids)}"
        save_peft(directory, state, config.lora, architecture=config.to_hf_dict()["architectures"][0])
        self._requests[name] = vllm_lora_request(
            **lora_request_args(name, version, next(self._ids), str(directory))
        )
        self.versions[name] = version
        kept = self._dirs.setdefault(name, [])
        kept.append(directory)
        while len(kept) > 2:  # the current version and the one before (requests still on it)
            shutil.rmtree(kept.pop(0), ignore_errors=True)

    def drop(self, name: str) -> None:
        self._requests.pop(name, None)
        self.versions.pop(name, None)
        for directory in self._dirs.pop(name, []):
            shutil.rmtree(directory, ignore_errors=True)
