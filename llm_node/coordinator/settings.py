"""CoordinatorSettings: the coordinator's knobs, one frozen dataclass.

The LLM node holds one as `LLMSettings.coordinator`; its fields are the node's flat flags
(`max_retries` -> --max-retries, ENCDIS_MAX_RETRIES) through encdis/settings_flags.py, which
builds nested settings dataclasses field by field. HELP has each field's flag text.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

COLOCATED_MODES = ("auto", "off", "require")
ON_OFF = ("on", "off")
ENCODER_DATATYPES = ("FP32", "BF16", "FP16")  # client.wire.DATATYPES, without importing the SDK here
IMAGE_LOADERS = ("vllm", "transformers")
ENCODER_TOWER_IMPLS = ("auto", "vllm", "transformers")  # client.wire.TOWER_IMPLS plus auto, as the datatypes
# Encoder nodes accept HTTP/2 pings this often (encoder_node/server.py's keepalive permit).
MIN_KEEPALIVE_SECONDS = 1.0


@dataclass(frozen=True)
class CoordinatorSettings:
    """How the coordinator finds, trusts, bounds and retries encoders, and caches embeddings."""

    encoders: tuple[str, ...] = ()  # host:port, static or DNS names (re-resolved)
    dns_server: str | None = None  # host:port of a DNS server to resolve encoder names with
    dns_refresh_seconds: float = 10.0
    cache_bytes: int = 256 * 1024 * 1024  # embedding cache (LRU by bytes); 0 disables
    max_retries: int = 3  # re-sends of one image to another encoder after a failure
    encode_timeout_seconds: float = 120.0
    # A request finding no SERVING encoder waits this long for encoders still connecting or
    # being re-checked after a failure, then fails with UNAVAILABLE.
    encoder_wait_seconds: float = 10.0
    describe_timeout_seconds: float = 10.0
    image_loader: str = "vllm"  # what encoders must use (encoder_node/image_loader.py); part of the digest
    # HTTP/2 pings on each encoder channel: a peer silent this long after a ping is dropped.
    keepalive_time_seconds: float = 10.0
    keepalive_timeout_seconds: float = 5.0
    # One attempt's bound once the encoder's cost model has data: max(floor, margin * predicted).
    attempt_timeout_floor_seconds: float = 2.0
    attempt_timeout_margin: float = 3.0
    # Out of rotation after bad data (quarantined) or a late attempt (slow): doubling per repeat.
    quarantine_seconds: float = 5.0
    quarantine_max_seconds: float = 300.0
    slow_seconds: float = 5.0
    slow_max_seconds: float = 60.0
    # RESOURCE_EXHAUSTED adds this many predicted seconds to the encoder's backlog, decaying.
    busy_seconds: float = 2.0
    # Between retry rounds in which every encoder failed the request: exponential, jittered.
    retry_backoff_seconds: float = 0.05
    retry_backoff_max_seconds: float = 1.0
    # Co-located transport (colocated.py): auto, off or require; bound of each transfer.
    colocated: str = "auto"
    colocated_timeout_seconds: float = 10.0
    # Encoders must send this datatype (identity.py). The LLM node's default is "auto", which it
    # resolves to its engine's dtype before the coordinator starts.
    encoder_datatype: str = "FP32"
    # The tower implementation encoders must run (identity.py); auto: vLLM's below FP32, transformers' in FP32.
    encoder_tower_impl: str = "auto"
    # How encoders are dialled: TLS verified against this CA, a client certificate, a key.
    encoder_tls_ca: Path | None = None
    encoder_tls_cert: Path | None = None
    encoder_tls_key: Path | None = None
    encoder_api_key_file: Path | None = None
    # Balance on the encoders' ORCA load reports (load_reports.py), asked every interval; a
    # report older than the max age counts for nothing (own view).
    load_reports: str = "on"
    load_report_interval_seconds: float = 0.1
    load_report_max_age_seconds: float = 1.0
    # Hedging (hedging.py): a second attempt for images past their predicted finish by a learned
    # margin, where another encoder would finish sooner; extra patches within the budget
    # (a fraction of the patches sent over the window). A winning hedge marks the encoder it beat
    # slow, as its attempt bound would have, so a frozen encoder leaves the rotation. Off by
    # default: on a host whose cores the engine shares, an ordinary late call can be hedged and
    # its encoder marked slow, which an operator should choose knowingly.
    hedge: str = "off"
    hedge_budget: float = 0.05
    hedge_window_seconds: float = 60.0
    hedge_check_seconds: float = 0.25
    hedge_min_margin_seconds: float = 0.05
    # Digest affinity (affinity.py): each image to its rendezvous-ranked encoder while that one is
    # within slack * the image's cost of the best finish; only over encoders that all cache.
    affinity: str = "on"
    affinity_slack: float = 1.0

    def __post_init__(self) -> None:
        for name in ("load_reports", "hedge", "affinity"):
            if getattr(self, name) not in ON_OFF:
                raise ValueError(f"--{name.replace('_', '-')} must be on or off, got {getattr(self, name)!r}")
        if self.load_report_interval_seconds < 0.01:
            raise ValueError(f"--load-report-interval-seconds must be >= 0.01 (encoders report no faster), "
                             f"got {self.load_report_interval_seconds}")
        if not 0 <= self.hedge_budget <= 1:
            raise ValueError(f"--hedge-budget must be a fraction in [0, 1], got {self.hedge_budget}")
        if (self.encoder_tls_cert is None) != (self.encoder_tls_key is None):
            raise ValueError("--encoder-tls-cert and --encoder-tls-key go together")
        if self.encoder_tls_cert is not None and self.encoder_tls_ca is None:
            raise ValueError("--encoder-tls-cert needs --encoder-tls-ca (the CA the encoders' certificates come from)")
        if self.max_retries < 0:
            raise ValueError(f"--max-retries must be >= 0, got {self.max_retries}")
        if self.image_loader not in IMAGE_LOADERS:
            raise ValueError(f"--image-loader must be vllm or transformers, got {self.image_loader!r}")
        if self.colocated not in COLOCATED_MODES:
            raise ValueError(f"--colocated must be one of {COLOCATED_MODES}, got {self.colocated!r}")
        if self.colocated_timeout_seconds <= 0:
            raise ValueError(f"--colocated-timeout-seconds must be positive, got {self.colocated_timeout_seconds}")
        if self.encoder_datatype not in ("auto", *ENCODER_DATATYPES):
            raise ValueError(f"--encoder-datatype must be auto or one of {ENCODER_DATATYPES}, "
                             f"got {self.encoder_datatype!r}")
        if self.encoder_tower_impl not in ENCODER_TOWER_IMPLS:
            raise ValueError(f"--encoder-tower-impl must be one of {', '.join(ENCODER_TOWER_IMPLS)}, "
                             f"got {self.encoder_tower_impl!r}")
        positive = ("keepalive_timeout_seconds", "attempt_timeout_floor_seconds", "quarantine_seconds",
                    "slow_seconds", "retry_backoff_seconds", "load_report_max_age_seconds", "hedge_window_seconds",
                    "hedge_check_seconds")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.keepalive_time_seconds < MIN_KEEPALIVE_SECONDS:
            # Encoders refuse pings more frequent than that (encoder_node/server.py).
            raise ValueError(f"--keepalive-time-seconds must be >= {MIN_KEEPALIVE_SECONDS}, "
                             f"got {self.keepalive_time_seconds}")
        if self.affinity_slack < 0:
            raise ValueError(f"--affinity-slack must be >= 0, got {self.affinity_slack}")
        if self.hedge_min_margin_seconds < 0:
            raise ValueError(f"--hedge-min-margin-seconds must be >= 0, got {self.hedge_min_margin_seconds}")
        if self.attempt_timeout_margin < 1 or self.busy_seconds < 0:
            raise ValueError("--attempt-timeout-margin must be >= 1 and --busy-seconds >= 0")
        for first, cap in (("quarantine_seconds", "quarantine_max_seconds"), ("slow_seconds", "slow_max_seconds"),
                           ("retry_backoff_seconds", "retry_backoff_max_seconds")):
            if getattr(self, cap) < getattr(self, first):
                raise ValueError(f"--{cap.replace('_', '-')} must be >= --{first.replace('_', '-')}")


HELP = {
    "encoders": "encoder nodes, comma-separated host:port (DNS names allowed)",
    "dns_server": "DNS server host:port used to resolve encoder names (empty: the system's resolver)",
    "dns_refresh_seconds": "how often encoder names are re-resolved",
    "cache_bytes": "embedding cache size in bytes (0 disables)",
    "max_retries": "re-sends of a failed image to another encoder",
    "encode_timeout_seconds": "longest bound of one Encode attempt (the bound until an encoder's cost is known)",
    "encoder_wait_seconds": "how long a request waits for an encoder to become usable before UNAVAILABLE",
    "describe_timeout_seconds": "deadline of an encoder's Describe",
    "image_loader": "the encoders' image loader (vllm or transformers); encoders using another are refused",
    "keepalive_time_seconds": "HTTP/2 ping interval on each encoder channel (>= 1; encoders permit that often)",
    "keepalive_timeout_seconds": "an encoder silent this long after a ping is disconnected",
    "attempt_timeout_floor_seconds": "smallest bound of one Encode attempt once the encoder's cost is known",
    "attempt_timeout_margin": "one Encode attempt may take this many times its predicted cost (with backlog)",
    "quarantine_seconds": "first back-off of an encoder that sent a wrong embedding (doubles on repeat)",
    "quarantine_max_seconds": "longest quarantine back-off",
    "slow_seconds": "first back-off of an encoder whose attempt ran past its bound (doubles on repeat)",
    "slow_max_seconds": "longest slow back-off",
    "busy_seconds": "predicted seconds added, decaying, to the backlog of an encoder that answered "
                    "RESOURCE_EXHAUSTED",
    "retry_backoff_seconds": "first pause between retry rounds when every encoder failed a request (jittered)",
    "retry_backoff_max_seconds": "longest pause between retry rounds",
    "colocated": "embedding bytes from encoders on this host over a pairwise torch.distributed group: auto "
                 "(NCCL pairs when both sides are on CUDA), off, or require (every encoder must open one; "
                 "gloo on CPU); failed transfers fall back to gRPC",
    "colocated_timeout_seconds": "bound of a co-located rendezvous and of each co-located transfer",
    "encoder_datatype": "datatype encoders must send embeddings in (FP32, BF16, FP16); auto: the engine's "
                        "dtype, as monolithic vLLM runs its tower; encoders sending another are refused",
    "encoder_tower_impl": "vision tower implementation encoders must run (vllm, transformers); auto: vllm when "
                          "embeddings are below FP32 (as vllm serve, whose tower rounds otherwise than "
                          "transformers' in bf16), transformers in FP32; encoders running another are refused",
    "encoder_tls_ca": "PEM CA bundle the encoders' certificates are verified with (TLS to encoders; a DNS "
                      "target's addresses are verified against its name); empty: plaintext",
    "encoder_tls_cert": "PEM client certificate chain for encoders that require one (mTLS)",
    "encoder_tls_key": "PEM private key of --encoder-tls-cert",
    "encoder_api_key_file": "file whose first line is the API key sent to encoders (or ENCDIS_ENCODER_API_KEY)",
    "load_reports": "on: balance on the encoders' ORCA load reports (their whole queue, other LLM nodes' work "
                    "included); off: on this node's own outstanding work only",
    "load_report_interval_seconds": "how often each encoder is asked to report its load (>= 0.01)",
    "load_report_max_age_seconds": "a load report older than this counts for nothing (own view instead)",
    "hedge": "on: an image running past its predicted finish by the learned margin gets a second attempt on "
             "an encoder predicted to finish it sooner; the first valid embedding wins, the other is cancelled",
    "hedge_budget": "hedged patches at most this fraction of the patches sent over --hedge-window-seconds",
    "hedge_window_seconds": "sliding window of the hedge budget",
    "hedge_check_seconds": "how often a waiting call is re-checked for a hedge",
    "hedge_min_margin_seconds": "smallest margin past the predicted finish before a hedge (the margin is the "
                                "p95 of recent prediction errors, at least this)",
    "affinity": "on: each image goes to the encoder its digest ranks first (rendezvous hashing, the same "
                "in every LLM node), so encoders' caches encode it once per fleet; only when every encoder "
                "has a cache (Describe's cache_bytes > 0); off: cost balance alone",
    "affinity_slack": "an image leaves its first-ranked encoder (for the next-ranked) once that one's predicted "
                      "finish is behind the best by more than this many times the image's own cost",
}
