"""How the cost of one MoE layer grows with the expert-parallel size: a model, printed as markdown.

    python benchmarks/ep_scaling.py [--tokens 8192] [--capacity-factor 1.25]

Per rank and direction: bytes of the dispatch, the combine and the backward (the layouts of
`mok.comm`: a token crosses once per remote owner; one row per (token, expert) pair returns; the
backward sends per-pair bf16 gradients to the owners and fp32 per-(token, owner) sums back), the
compute (FLOPs counted as in `docs/reference-machine.md`), the time of both at measured rates,
their ratio, the smallest overlap chunk, and the receive buffers. Routing is uniform top-k without
replacement; experts are split evenly, expert e on rank e // (E / ep). `docs/ep-scaling.md` holds
the output.

No GPU is used: every time here is bytes or FLOPs divided by a rate. The rates marked "measured"
come from the 2 x H200 machine (`docs/reference-machine.md`, `benchmarks/results/`); the others are
assumptions, named as such.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import mok

EP_SIZES = (2, 4, 8, 16, 32, 64)
PRESETS = ("deepseek-v3", "kimi-k2", "qwen3-235b-a22b", "qwen3-30b-a3b", "mixtral-8x7b")

# Measured (docs/reference-machine.md, 2 x H200, 2026-11-30).
DENSE_TFLOPS = 794.0  # cuBLAS bf16 GEMM 8192^3
NVLINK_COPY_ENGINE = 387e9  # bytes/s per direction, tensor.copy_ into a peer symmetric buffer
SMS = 132
# Measured: our expert-MLP kernels, forward / backward TFLOP/s at 8192 tokens x top-k rows with all
# the preset's experts on one GPU (benchmarks/results/2026-11-30-expert-kernels-h200-x2.md).
KERNEL_TFLOPS = {
    "qwen3-30b-a3b": (518.0, 445.0),
    "qwen3-235b-a22b": (521.0, 484.0),
    "deepseek-v3": (469.0, 402.0),
    "kimi-k2": (391.0, 306.0),
    "mixtral-8x7b": (593.0, 579.0),
}

# Assumptions (models, not measured).
NVLINK_24_SMS = 330e9  # target per direction for a 24-SM exchange (measured: 232 naive, 337 at 64)
COMM_SMS = 24  # SMs the fused kernel gives to communication; GEMMs run on the rest
INTER_NODE = 50e9  # per GPU and direction: one 400 Gb/s InfiniBand/RoCE NIC per GPU
GPUS_PER_NODE = 8  # NVLink domain of an HGX H200 node
TILE_M = 128  # rows of a GEMM tile

BF16, FP32 = 2, 4


def p_no_expert_on(num_experts: int, owned: int, top_k: int) -> float:
    """Probability that a rank owning `owned` of the experts gets none of a token's top_k picks
    (k distinct experts drawn uniformly): C(E - owned, k) / C(E, k)."""
    return math.comb(num_experts - owned, top_k) / math.comb(num_experts, top_k)


def p_remote(num_experts: int, ep: int, top_k: int) -> float:
    """Expected number of distinct remote ranks a token must reach, L = E / ep experts per rank:
    (ep - 1)(1 - C(E - L, k) / C(E, k))."""
    return (ep - 1) * (1 - p_no_expert_on(num_experts, num_experts // ep, top_k))


@dataclasses.dataclass(frozen=True)
class Scaling:
    """One layer at one EP size, per rank (expectations under uniform routing)."""

    preset: str
    ep: int
    tokens: int
    config: mok.MoKConfig

    @property
    def local_experts(self) -> int:
        return self.config.num_experts // self.ep

    @property
    def p_remote(self) -> float:
        return p_remote(self.config.num_experts, self.ep, self.config.top_k)

    @property
    def p_owner(self) -> float:
        """Probability that a given rank owns at least one of a token's experts."""
        c = self.config
        return 1 - p_no_expert_on(c.num_experts, self.local_experts, c.top_k)

    @property
    def remote_pairs_per_token(self) -> float:
        return self.config.top_k * (1 - 1 / self.ep)

    def row_bytes(self, element: int = BF16) -> int:
        return self.config.hidden_size * element

    # -- bytes per rank and direction ----------------------------------------------------------

    @property
    def dispatch_bytes(self) -> float:
        return self.tokens * self.row_bytes() * self.p_remote

    @property
    def combine_bytes(self) -> float:
        return self.tokens * self.remote_pairs_per_token * self.row_bytes()

    @property
    def backward_pair_bytes(self) -> float:
        """combine_backward: w[t, j] * grad_y[t] per remote pair, bf16, token rank -> owner."""
        return self.combine_bytes

    @property
    def backward_sum_bytes(self) -> float:
        """dispatch_backward: fp32 sums per (token, remote owner), owner -> token rank."""
        return self.tokens * self.row_bytes(FP32) * self.p_remote

    @property
    def metadata_bytes(self) -> float:
        """route: (grouped row, staging row) int64 per remote pair; the counts are O(E + ep)."""
        return self.tokens * self.remote_pairs_per_token * 16

    @property
    def forward_bytes(self) -> float:
        return self.dispatch_bytes + self.combine_bytes

    @property
    def backward_bytes(self) -> float:
        return self.backward_pair_bytes + self.backward_sum_bytes

    # -- compute per rank (independent of ep) ------------------------------------------------------

    @property
    def forward_flops(self) -> int:
        return self.config.forward_flops(self.tokens)

    def compute_s(self, direction: str, rate: str) -> float:
        """Compute time: rate "dense" (794 TFLOP/s), "kernel" (our measured expert kernels, all
        FLOPs at that rate) or "fused" (kernel rate on the SMs left after COMM_SMS)."""
        flops = self.forward_flops * (1 if direction == "fwd" else 2)
        if rate == "dense":
            return flops / (DENSE_TFLOPS * 1e12)
        tflops = KERNEL_TFLOPS[self.preset][0 if direction == "fwd" else 1]
        if rate == "fused":
            tflops *= (SMS - COMM_SMS) / SMS
        return flops / (tflops * 1e12)

    def comm_bytes(self, direction: str) -> float:
        return self.forward_bytes if direction == "fwd" else self.backward_bytes

    def comm_s(self, direction: str, bandwidth: float = NVLINK_24_SMS) -> float:
        return self.comm_bytes(direction) / bandwidth

    # -- beyond one NVLink node -------------------------------------------------------------------

    def split_by_node(self, direction: str) -> tuple[float, float]:
        """(bytes to remote ranks in this node, bytes to other nodes), GPUS_PER_NODE per node."""
        ep = self.ep
        inside, outside = min(ep, GPUS_PER_NODE) - 1, max(ep - GPUS_PER_NODE, 0)
        peer_tokens = self.p_owner * self.tokens * self.row_bytes()  # dispatch to one peer
        peer_pairs = self.tokens * self.config.top_k / ep * self.row_bytes()  # combine from one
        if direction == "fwd":
            peer = peer_tokens + peer_pairs
        else:
            peer = peer_pairs + 2 * peer_tokens  # fp32 sums: twice the bf16 row
        return inside * peer, outside * peer

    def inter_node_comm_s(self, direction: str) -> float:
        """NVLink inside the node and the NIC outside it run at once: the slower one counts."""
        inside, outside = self.split_by_node(direction)
        return max(inside / NVLINK_24_SMS, outside / INTER_NODE)

    @property
    def remote_nodes_per_token(self) -> float:
        """Distinct remote nodes per token: the inter-node dispatch rows if a token crossed once
        per node and was forwarded inside it over NVLink (not our design; for comparison)."""
        c, nodes = self.config, self.ep // GPUS_PER_NODE
        if nodes <= 1:
            return 0.0
        node_experts = c.num_experts // nodes
        return (nodes - 1) * (1 - p_no_expert_on(c.num_experts, node_experts, c.top_k))

    # -- overlap ---------------------------------------------------------------------------------

    @property
    def chunk(self) -> int:
        """Smallest overlap chunk, tokens per rank (a multiple of 64): each local expert gets one
        full TILE_M-row tile per chunk on average (a chunk of c tokens on every rank brings c * k
        pairs to each owner, over E / ep experts). Any larger chunk hides the communication of
        chunk i + 1 under the GEMMs of chunk i whenever compute is the slower of the two; no
        chunk does when communication is."""
        tokens = TILE_M * self.local_experts / self.config.top_k
        return min(64 * math.ceil(tokens / 64), self.tokens)

    def fill_drain_s(self, direction: str, comm_s: float) -> float:
        """What a pipeline of n = T / chunk chunks leaves exposed: min(compute, comm) / n (the
        first chunk's inbound and the last chunk's outbound transfer when compute bound; the GEMMs
        of one chunk when communication bound)."""
        chunks = self.tokens / self.chunk
        return min(self.compute_s(direction, "fused"), comm_s) / chunks

    def overlapped_s(self, direction: str, comm_s: float) -> float:
        """Modelled layer time: max(compute on the GEMM SMs, communication) + fill + drain."""
        compute = self.compute_s(direction, "fused")
        return max(compute, comm_s) + self.fill_drain_s(direction, comm_s)

    # -- receive buffers (memory per rank) ------------------------------------------------------

    def buffers(self, capacity_factor: float) -> dict[str, tuple[float, float]]:
        """(worst case, capacity_factor x expected) bytes of each receive buffer, own rank's rows
        included (they are copied locally like the others)."""
        c, t, ep = self.config, self.tokens, self.ep
        row, row32 = self.row_bytes(), self.row_bytes(FP32)
        staging_worst = ep * t
        pairs_worst = ep * t * min(c.top_k, self.local_experts)
        sums_worst = t * min(c.top_k, ep)

        def sized(worst: float, expected: float) -> float:
            return min(worst, capacity_factor * expected)

        return {
            "staging": (staging_worst * row, sized(staging_worst, ep * t * self.p_owner) * row),
            "pair rows": (pairs_worst * row, sized(pairs_worst, t * c.top_k) * row),
            "combine slots": (t * c.top_k * row, t * c.top_k * row),
            "fp32 sums": (sums_worst * row32, sized(sums_worst, ep * t * self.p_owner) * row32),
        }


def scalings(tokens: int) -> list[Scaling]:
    out = []
    for name in PRESETS:
        config = mok.get_preset(name).config()
        for ep in EP_SIZES:
            if config.num_experts % ep == 0 and ep <= config.num_experts:
                out.append(Scaling(name, ep, tokens, config))
    return out


# ------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.2f}"


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.0f}"


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f}"


def compute_table(items: list[Scaling]) -> str:
    rows = []
    for s in items:
        if s.ep != 2:
            continue
        fwd_k, bwd_k = KERNEL_TFLOPS[s.preset]
        rows.append(
            [
                s.preset,
                f"{s.forward_flops / 1e12:.2f} / {2 * s.forward_flops / 1e12:.2f}",
                f"{ms(s.compute_s('fwd', 'dense'))} / {ms(s.compute_s('bwd', 'dense'))}",
                f"{fwd_k:.0f} / {bwd_k:.0f}",
                f"{ms(s.compute_s('fwd', 'kernel'))} / {ms(s.compute_s('bwd', 'kernel'))}",
                f"{ms(s.compute_s('fwd', 'fused'))} / {ms(s.compute_s('bwd', 'fused'))}",
            ]
        )
    header = [
        "preset",
        "TFLOP fwd / bwd",
        "ms at 794 TFLOP/s fwd / bwd",
        "kernel TFLOP/s fwd / bwd (measured)",
        "ms at kernel rate fwd / bwd",
        f"ms on {SMS - COMM_SMS} SMs fwd / bwd",
    ]
    return table(header, rows)


def bytes_table(items: list[Scaling]) -> str:
    rows = []
    for s in items:
        rows.append(
            [
                s.preset,
                str(s.ep),
                f"{s.p_remote:.3f}",
                f"{s.remote_pairs_per_token:.2f}",
                mb(s.dispatch_bytes),
                mb(s.combine_bytes),
                mb(s.backward_pair_bytes),
                mb(s.backward_sum_bytes),
                f"{ms(s.comm_s('fwd', NVLINK_COPY_ENGINE))} / {ms(s.comm_s('fwd'))}",
                f"{ms(s.comm_s('bwd', NVLINK_COPY_ENGINE))} / {ms(s.comm_s('bwd'))}",
            ]
        )
    header = [
        "preset",
        "ep",
        "P(remote)",
        "remote pairs/token",
        "dispatch MB",
        "combine MB",
        "bwd pair grads MB",
        "bwd fp32 sums MB",
        "fwd ms at 387 / 330 GB/s",
        "bwd ms at 387 / 330 GB/s",
    ]
    return table(header, rows)


def metadata_note(items: list[Scaling]) -> str:
    worst = max(items, key=lambda s: s.metadata_bytes / s.combine_bytes)
    return (
        f"Not in the table: `route` sends 16 bytes of addresses per remote pair, at most "
        f"{100 * worst.metadata_bytes / worst.combine_bytes:.2f} % of the combine bytes "
        f"({worst.preset}, {mb(worst.metadata_bytes)} MB at ep={worst.ep}), and all-gathers "
        "(E + ep) int64 counts per rank."
    )


def overlap_table(items: list[Scaling], inter_node: bool) -> str:
    rows = []
    for s in items:
        if inter_node and s.ep <= GPUS_PER_NODE:
            continue
        row = [s.preset, str(s.ep)]
        if inter_node:
            inside, outside = s.split_by_node("fwd")
            off_node_rows = s.p_remote - s.p_owner * (GPUS_PER_NODE - 1)
            row += [
                f"{mb(inside)} / {mb(outside)}",
                f"{off_node_rows:.2f} / {s.remote_nodes_per_token:.2f}",
            ]
        row.append(str(s.chunk))
        for direction in ("fwd", "bwd"):
            comm = s.inter_node_comm_s(direction) if inter_node else s.comm_s(direction)
            row += [
                ms(comm),
                f"{s.compute_s(direction, 'fused') / comm:.2f}",
                ms(s.fill_drain_s(direction, comm)),
                ms(s.overlapped_s(direction, comm)),
            ]
        rows.append(row)
    header = ["preset", "ep"]
    if inter_node:
        header += ["fwd MB in node / off node", "off-node rows/token: ours / once per node"]
    header.append("chunk")
    for direction in ("fwd", "bwd"):
        header += [
            f"{direction} comm ms",
            f"{direction} ratio",
            f"{direction} fill+drain ms",
            f"{direction} layer ms",
        ]
    return table(header, rows)


def memory_table(items: list[Scaling], capacity_factor: float) -> str:
    rows = []
    for s in items:
        buffers = s.buffers(capacity_factor)
        row = [s.preset, str(s.ep)]
        for name in ("staging", "pair rows", "fp32 sums"):
            worst, sized = buffers[name]
            row.append(f"{gib(worst)} / {gib(sized)}")
        row.append(gib(buffers["combine slots"][0]))
        rows.append(row)
    f = f"{capacity_factor:g}"
    header = [
        "preset",
        "ep",
        f"staging (owner) worst / {f}x expected",
        f"bwd pair grads (owner) worst / {f}x expected",
        f"bwd fp32 sums (token rank) worst / {f}x expected",
        "combine slots (token rank)",
    ]
    return table(header, rows)


def report(tokens: int, capacity_factor: float) -> str:
    items = scalings(tokens)
    fused = f"{SMS - COMM_SMS} SMs"
    return "\n\n".join(
        [
            f"### Compute per rank ({tokens} tokens per rank; the same at every ep)",
            compute_table(items),
            f"### Bytes per rank and direction ({tokens} tokens per rank, uniform routing)",
            bytes_table(items),
            metadata_note(items),
            f"### Overlap inside one NVLink domain ({NVLINK_24_SMS / 1e9:.0f} GB/s, GEMMs on "
            f"{fused} at the measured kernel rate)",
            overlap_table(items, inter_node=False),
            f"### Overlap beyond {GPUS_PER_NODE} GPUs over a {INTER_NODE / 1e9:.0f} GB/s "
            f"network (NVLink inside each node of {GPUS_PER_NODE})",
            overlap_table(items, inter_node=True),
            f"### Receive buffers per rank, GiB ({tokens} tokens per rank)",
            memory_table(items, capacity_factor),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank (8192)")
    parser.add_argument(
        "--capacity-factor", type=float, default=1.25, help="receive buffers / expected (1.25)"
    )
    args = parser.parse_args(argv)
    print(report(args.tokens, args.capacity_factor))


if __name__ == "__main__":
    main()
