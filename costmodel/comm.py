"""Time of the collectives Elastor uses, from a latency + bandwidth (alpha-beta) model.

Ring algorithms (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005): on n ranks, all-reduce
moves 2(n-1)/n of the buffer through every rank's link in 2(n-1) steps; all-gather and
reduce-scatter move (n-1)/n in n-1 steps; point-to-point moves the buffer once. A measured fit from
`elastor profile --comm` (the cluster's `links.collectives`) replaces the datasheet figures.
"""

from dataclasses import dataclass

from costmodel.cluster import LinkSpec

# Per-message latency when nothing was measured: NVLink / InfiniBand-class fabrics are a few
# microseconds per hop (NCCL's own tuning tables use ~5-10 us for a ring step).
DEFAULT_LATENCY_S = 10e-6

GB = 1e9  # the `_gbps` fields are 1e9 bytes per second


@dataclass(frozen=True)
class Link:
    latency_s: float
    bandwidth_gbps: float

    def transfer_s(self, num_bytes: float, steps: int = 1) -> float:
        return steps * self.latency_s + num_bytes / (self.bandwidth_gbps * GB)


def link(links: LinkSpec, collective: str, inter_node: bool) -> Link:
    """The alpha-beta model of `collective` (all_reduce, all_gather, reduce_scatter, p2p) in one scope."""
    scope = "inter_node" if inter_node else "intra_node"
    fit = links.collectives.get(collective, {}).get(scope)
    if fit:
        return Link(latency_s=float(fit["latency_s"]), bandwidth_gbps=float(fit["bandwidth_gbps"]))
    bandwidth = links.inter_node_gbps if inter_node else links.intra_node_gbps
    return Link(latency_s=DEFAULT_LATENCY_S, bandwidth_gbps=bandwidth)


def all_reduce_s(num_bytes: float, n: int, via: Link) -> float:
    """Ring all-reduce of a `num_bytes` buffer on n ranks: 2(n-1)/n of it through each link."""
    if n <= 1:
        return 0.0
    return via.transfer_s(2 * (n - 1) / n * num_bytes, steps=2 * (n - 1))


def all_gather_s(num_bytes: float, n: int, via: Link) -> float:
    """Ring all-gather producing a `num_bytes` buffer on n ranks: (n-1)/n of it per link."""
    if n <= 1:
        return 0.0
    return via.transfer_s((n - 1) / n * num_bytes, steps=n - 1)


def reduce_scatter_s(num_bytes: float, n: int, via: Link) -> float:
    """Ring reduce-scatter of a `num_bytes` buffer on n ranks: (n-1)/n of it per link."""
    return all_gather_s(num_bytes, n, via)


def p2p_s(num_bytes: float, via: Link) -> float:
    return via.transfer_s(num_bytes)
