"""An estimate of what the cluster costs while it exists, from the dated prices in :mod:`helpers.cluster.prices`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from helpers.cluster import prices as azure_data
from helpers.cluster.azure.spec import AzureSpecError, ClusterSpec


@dataclass(frozen=True)
class CostEstimate:
    """An ESTIMATE of what the cluster costs while it exists (not a quote)."""

    per_hour: float
    hours: float
    items: tuple[tuple[str, float], ...]
    location: str = azure_data.PRICES_REGION  # where the cluster will run (the prices are East US's)

    @property
    def total(self) -> float:
        return round(self.per_hour * self.hours, 2)

    def __str__(self) -> str:
        region = f"{azure_data.PRICES_REGION_NAME} ({azure_data.PRICES_REGION})"
        lines = [
            f"ESTIMATE, not a quote: ${self.per_hour:.3f}/hour, ${self.total:.2f} for {self.hours:g} h, "
            f"at {region} list prices"
        ]
        if self.location != azure_data.PRICES_REGION:
            lines.append(
                f"  The cluster's location is {self.location}: its prices differ from {region}'s; "
                "check them in the calculator below."
            )
        lines += [f"  {name}: ${price:.3f}/h" for name, price in self.items]
        lines += [
            f"  {azure_data.NOT_ESTIMATED}.",
            f"  Prices of {azure_data.PRICES_CHECKED_ON}: {azure_data.PRICES_SOURCE}",
        ]
        return "\n".join(lines)


def estimate_cost(
    spec: ClusterSpec, hours: float = 1.0, vm_price_per_hour: float | None = None
) -> CostEstimate:
    """Estimate the cost of the planned cluster: nodes x size price, NAT gateway, public IPs.

    Args:
        spec: the cluster.
        hours: how long it will exist (billing runs until teardown, not only while training).
        vm_price_per_hour: price of one VM, for sizes missing from the price table.

    Returns:
        The estimate; ``str()`` of it is a labelled, dated breakdown naming the region priced (East
        US) and, if the cluster's location is another, that its prices differ.

    Raises:
        AzureSpecError: ``hours`` is not a positive number, ``vm_price_per_hour`` not a number of 0
            or more, or the size has no price in the table and none was given.
    """
    if not (math.isfinite(hours) and hours > 0):
        raise AzureSpecError(f"hours={hours:g}: must be a positive number of hours, e.g. --hours 8")
    if vm_price_per_hour is not None and not (math.isfinite(vm_price_per_hour) and vm_price_per_hour >= 0):
        raise AzureSpecError(
            f"vm_price_per_hour={vm_price_per_hour:g}: must be a price in USD of 0 or more, e.g. 0.192"
        )
    if vm_price_per_hour is None:
        vm_price_per_hour = azure_data.vm_usd_per_hour(spec.vm_size)
        if vm_price_per_hour is None:
            raise AzureSpecError(
                f"vm_size={spec.vm_size!r}: no price in helpers.cluster.prices (checked {azure_data.PRICES_CHECKED_ON}). "
                "Fix: pass vm_price_per_hour= from https://azure.microsoft.com/pricing/calculator/"
            )
    items = (
        (f"{spec.node_count} x {spec.vm_size}", round(spec.node_count * vm_price_per_hour, 4)),
        ("NAT gateway", azure_data.NAT_GATEWAY_USD_PER_HOUR),
        ("2 public IPs (head, NAT)", 2 * azure_data.PUBLIC_IP_USD_PER_HOUR),
    )
    return CostEstimate(round(sum(price for _, price in items), 4), hours, items, spec.location)
