"""encdis's encoder-cache connector for vLLM: image embeddings read from the node's shared region.

Loaded by vLLM from outside its tree (`ec_connector_module_path`), as a consumer: requests carry
only each image's digest (its uuid) and grid, from which vLLM expands the placeholders; the rows
are in the region the node wrote (llm_node/embedding_region.py explains its files). No tensor
goes through the engine's request path, its engine core or its broadcast to the workers.

Scheduler side (engine core): before a request is scheduled, each of its digests is pinned for it
by a hard link, so the rows cannot go away while the request lives in the core, even if the node
has already given it up (an abort on its way); a request whose rows are not in the region is
failed with an error, never run without them. Each load scheduled gets one link per rank.
Worker side: each rank maps its link (a view on CPU; one host-to-device copy on GPU) into vLLM's
encoder cache under the digest and removes the link.

On GPU the copy reads the mapped pages as they are (pageable memory, staged by the driver). Each
rank copies a mapping once, so pinning it first (cudaHostRegister locks and maps every page, a
walk over the same bytes) would add its cost to the one copy it speeds up (reasoned; not yet
measured on a GPU).
"""

from __future__ import annotations

import itertools
import mmap
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from encdis.llm_node.embedding_region import SAFE_DIGEST, load_name, pin_name, remove_file

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

CONNECTOR_NAME = "EncdisECConnector"


@dataclass
class RegionLoads(ECConnectorMetadata):
    """One step's loads: (digest, load id, rows) for every embedding the workers map this step."""

    loads: list[tuple[str, int, int]] = field(default_factory=list)


class EncdisECConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        ec_config = vllm_config.ec_transfer_config
        self.region = ec_config.ec_connector_extra_config["region"]
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1 or parallel.data_parallel_size != 1:
            raise ValueError(f"{CONNECTOR_NAME} supports tensor parallelism only")
        self.ranks = parallel.tensor_parallel_size
        self.dtype = vllm_config.model_config.dtype
        self.hidden = vllm_config.model_config.get_inputs_embeds_size()
        self.element = torch.empty(0, dtype=self.dtype).element_size()
        # Scheduler side.
        self._pins: dict[str, list[str]] = {}  # request id -> digests pinned for it
        self._pinned: dict[str, int] = {}  # digest -> requests holding a pin on it
        self._unavailable: set[str] = set()
        self._step = RegionLoads()
        self._load_ids = itertools.count()

    def _path(self, name: str) -> str:
        return os.path.join(self.region, name)

    # ---- scheduler side -------------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        rid = request.request_id
        if rid in self._pins:
            return True
        if rid in self._unavailable:
            return False
        digests = list(dict.fromkeys(f.identifier for f in request.mm_features))
        pinned: list[str] = []
        try:
            for digest in digests:
                if not SAFE_DIGEST.fullmatch(digest):
                    raise FileNotFoundError(digest)
                os.link(self._path(digest), self._path(pin_name(digest, rid)))
                pinned.append(digest)
        except OSError:
            # The node no longer holds these rows (the request was given up on its way in):
            # fail the request rather than run it without them.
            self._unpin(rid, pinned)
            self._unavailable.add(rid)
            return False
        self._pins[rid] = pinned
        for digest in pinned:
            self._pinned[digest] = self._pinned.get(digest, 0) + 1
        return True

    def has_cache_item(self, identifier: str) -> bool:
        return identifier in self._pinned

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        digest = request.mm_features[index].identifier
        load_id = next(self._load_ids)
        pin = self._path(pin_name(digest, request.request_id))
        for rank in range(self.ranks):
            os.link(pin, self._path(load_name(digest, load_id, rank)))
        self._step.loads.append((digest, load_id, request.get_num_encoder_embeds(index)))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        step, self._step = self._step, RegionLoads()
        return step

    def take_unavailable_requests(self) -> set[str]:
        taken, self._unavailable = self._unavailable, set()
        return taken

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._unavailable.discard(rid)
        digests = self._pins.pop(rid, [])
        for digest in digests:
            left = self._pinned.get(digest, 0) - 1
            if left > 0:
                self._pinned[digest] = left
            else:
                self._pinned.pop(digest, None)
        self._unpin(rid, digests)
        return False, None

    def _unpin(self, rid: str, digests: list[str]) -> None:
        for digest in digests:
            remove_file(self._path(pin_name(digest, rid)))

    # ---- worker side ----------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.platforms import current_platform

        metadata = self._get_connector_metadata()
        assert isinstance(metadata, RegionLoads)
        rank = get_tensor_model_parallel_rank()
        device = torch.device(current_platform.device_type)
        if current_platform.is_cuda_alike():
            device = torch.device(device.type, current_platform.current_device())
        for digest, load_id, rows in metadata.loads:
            path = self._path(load_name(digest, load_id, rank))
            try:
                if digest not in encoder_cache:
                    encoder_cache[digest] = self._map(path, rows).to(device)
            finally:
                remove_file(path)

    def _map(self, path: str, rows: int) -> torch.Tensor:
        want = rows * self.hidden * self.element
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != want:
                raise RuntimeError(f"embedding {os.path.basename(path)} in the region has {size} bytes, "
                                   f"expected {rows} rows x {self.hidden} x {self.element} = {want}")
            # A private mapping: the tensor is writable as torch wants, and shares the file's pages
            # unless something writes to it.
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        return torch.frombuffer(mapped, dtype=self.dtype).view(rows, self.hidden)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        return  # a consumer: the encoders produce

