"""Static tables behind :mod:`helpers.cluster.azure`: what each Azure VM size's CPU can do, and prices.

Both tables are dated and name their sources. They are facts about a moving target: re-check
them before a workshop (``az vm list-skus``, the Azure size pages, the Retail Prices API).

Why the CPU matters: bf16 on a CPU without native bf16 is many times *slower* than fp32 (see
docs/architecture.md), so the workshop only picks bf16 where the CPU has AVX512-BF16 or AMX.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

SIZES_CHECKED_ON = "2026-11-23"
SIZES_SOURCES = (
    "https://learn.microsoft.com/azure/virtual-machines/sizes/general-purpose/dv5-series "
    "(MicrosoftDocs/azure-docs articles/virtual-machines/sizes/general-purpose/includes/dv5-series-specs.md: "
    "'Intel Xeon Platinum 8473C (Sapphire Rapids), Intel Xeon Platinum 8370C (Ice Lake)')",
    "https://learn.microsoft.com/azure/virtual-machines/sizes/general-purpose/dsv6-series and ddsv6-series "
    "('5th Generation Intel Xeon Platinum 8473C (Emerald Rapids)'; 8473C is also the Sapphire Rapids part "
    "named for Dv5: either way a CPU with AMX)",
    "https://learn.microsoft.com/azure/virtual-machines/sizes/memory-optimized/esv6-series (Emerald Rapids)",
    "https://learn.microsoft.com/azure/virtual-machines/ev5-esv5-series (Sapphire Rapids or Ice Lake)",
    "Intel: AMX (with AMX-BF16) and AVX512-BF16 are built into 4th (Sapphire Rapids) and 5th (Emerald "
    "Rapids) Gen Xeon Scalable; 3rd Gen Ice Lake-SP has AVX-512 and VNNI but neither AMX nor AVX512-BF16.",
)


@dataclass(frozen=True)
class SizeSeries:
    """What one Azure VM series offers for this workshop.

    ``amx``/``native_bf16`` are ``True``/``False``, or ``None`` when Azure documents a mixed fleet
    for the series (the CPU, and so bf16, depends on the host the VM lands on).
    """

    series: str
    pattern: str
    cpu: str
    amx: bool | None
    native_bf16: bool | None
    accelerated_networking: bool
    usd_per_vcpu_hour: float | None  # Linux pay-as-you-go, East US; None: not in the price table


# Regexes are matched against the full size name, e.g. "Standard_D8_v5".
SIZE_SERIES: tuple[SizeSeries, ...] = (
    SizeSeries(
        "Dv5/Dsv5",
        r"Standard_D\d+s?_v5",
        "Xeon Platinum 8370C (Ice Lake) or 8473C (Sapphire Rapids), depending on the host",
        None,
        None,
        True,
        0.048,
    ),
    SizeSeries(
        "Ev5/Esv5",
        r"Standard_E\d+s?_v5",
        "Xeon Platinum 8370C (Ice Lake) or 8473C (Sapphire Rapids), depending on the host",
        None,
        None,
        True,
        0.063,
    ),
    SizeSeries(
        "Dsv6/Ddsv6", r"Standard_D\d+d?s_v6", "5th Gen Xeon Platinum (Emerald Rapids)", True, True, True, None
    ),
    SizeSeries(
        "Esv6/Edsv6", r"Standard_E\d+d?s_v6", "5th Gen Xeon Platinum (Emerald Rapids)", True, True, True, None
    ),
)

PRICES_CHECKED_ON = "2026-11-23"
PRICES_SOURCE = (
    "Azure list prices, Linux pay-as-you-go, East US, USD, as known on that date and cross-checked where a "
    "public copy of the price list was at hand (Standard_D8s_v5 = $280.32/month = $0.384/h). NOT fetched "
    "live (the development machines have no web access): check the Retail Prices API "
    "(https://prices.azure.com/api/retail/prices) or https://azure.microsoft.com/pricing/calculator/. "
    "Other regions, discounts, savings plans and spot prices differ."
)
PRICES_REGION = "eastus"
"""The region every price here is for (East US); other regions' prices differ."""
PRICES_REGION_NAME = "East US"
# Per-hour prices of the network pieces of the plan (same source and date).
NAT_GATEWAY_USD_PER_HOUR = 0.045  # plus $0.045 per GB processed, not estimated here
PUBLIC_IP_USD_PER_HOUR = 0.005  # Standard SKU, static IPv4
NOT_ESTIMATED = "OS disks, data transfer and NAT gateway data processing are not included"


def size_series(vm_size: str) -> SizeSeries | None:
    """The table row for ``vm_size`` (e.g. ``"Standard_D8_v5"``), or ``None`` if it is not in the table."""
    return next((row for row in SIZE_SERIES if re.fullmatch(row.pattern, vm_size)), None)


def vcpus(vm_size: str) -> int | None:
    """Number of vCPUs encoded in an Azure size name (``Standard_D8_v5`` -> 8), or ``None``."""
    match = re.fullmatch(r"Standard_[A-Z]+(\d+)[a-z-]*_v\d+", vm_size)
    return int(match.group(1)) if match else None


def vm_usd_per_hour(vm_size: str) -> float | None:
    """List price of one ``vm_size`` VM (USD per hour, :data:`PRICES_REGION`), or ``None`` if not in the table."""
    row, cpus = size_series(vm_size), vcpus(vm_size)
    if row is None or row.usd_per_vcpu_hour is None or cpus is None:
        return None
    return round(row.usd_per_vcpu_hour * cpus, 4)


def bf16_advice(vm_size: str) -> str:
    """One sentence on whether training in bf16 is a good idea on ``vm_size``."""
    row = size_series(vm_size)
    if row is None:
        return (
            f"{vm_size} is not in helpers.cluster.prices.SIZE_SERIES, so whether its CPU has native bf16 "
            "(AVX512-BF16/AMX) is unknown: check on a node with helpers.core.cpu before choosing bf16, "
            "because bf16 without hardware support is many times slower than fp32."
        )
    if row.native_bf16 is None:
        return (
            f"{vm_size} ({row.series}) runs on {row.cpu}: native bf16 is NOT guaranteed. Let helpers.core.cpu "
            "decide on each node (mixed_precision='auto'), or pick a v6 size (Emerald Rapids, AMX) for bf16."
        )
    if row.native_bf16:
        return f"{vm_size} ({row.series}) runs on {row.cpu}, which has AMX and AVX512-BF16: bf16 is fast."
    return f"{vm_size} ({row.series}) runs on {row.cpu}, which has no native bf16: train in fp32."


NETWORK_CHECKED_ON = "2026-11-24"
NETWORK_SOURCES = (
    "The 'Network' tab (Max Network Bandwidth, Mbps) of each series' size page, "
    "https://learn.microsoft.com/azure/virtual-machines/sizes/<family>/<series>-series "
    "(MicrosoftDocs/azure-compute-docs: general-purpose/dv5-series.md, general-purpose/dsv6-series.md, "
    "memory-optimized/ev5-series.md, memory-optimized/esv6-series.md). Azure: the maximum aggregated "
    "bandwidth per VM across all NICs, an upper limit and not guaranteed. The s/d variants of a series "
    "(Dsv5, Ddsv6, Esv5, Edsv6) are assumed to have the same limits as the sizes listed there; the "
    "isolated sizes (E104i_v5, E192is_v6) are not in SIZE_SERIES and not listed here.",
)
# Series (as in SIZE_SERIES) -> vCPUs -> expected network bandwidth in Mbit/s (same sources and date).
NETWORK_MBPS: dict[str, dict[int, int]] = {
    "Dv5/Dsv5": {2: 12_500, 4: 12_500, 8: 12_500, 16: 12_500, 32: 16_000, 48: 24_000, 64: 30_000, 96: 35_000},
    "Ev5/Esv5": {2: 12_500, 4: 12_500, 8: 12_500, 16: 12_500, 20: 12_500, 32: 16_000, 48: 24_000,
                 64: 30_000, 96: 30_000},
    "Dsv6/Ddsv6": {2: 12_500, 4: 12_500, 8: 12_500, 16: 12_500, 32: 16_000, 48: 24_000, 64: 30_000,
                   96: 41_000, 128: 54_000, 192: 82_000},
    "Esv6/Edsv6": {2: 12_500, 4: 12_500, 8: 12_500, 16: 12_500, 20: 12_500, 32: 16_000, 48: 24_000,
                   64: 30_000, 96: 41_000, 128: 54_000},
}  # fmt: skip


def network_gbps(vm_size: str) -> float | None:
    """Azure's expected network bandwidth of ``vm_size`` in Gbit/s (``Standard_D8_v5`` -> 12.5), or
    ``None`` for a size missing from :data:`NETWORK_MBPS`."""
    row, cpus = size_series(vm_size), vcpus(vm_size)
    mbps = NETWORK_MBPS.get(row.series, {}).get(cpus) if row and cpus else None
    return mbps / 1000 if mbps else None


REGIONS_CHECKED_ON = "2026-11-23"
REGIONS_SOURCE = (
    "The physical regions of Azure's public cloud as `az account list-locations --query \"[?metadata.regionType"
    "=='Physical'].name\" -o tsv` names them, as known on that date (NOT fetched live; staging and EUAP "
    "regions left out). A region opened since then is refused until it is added here."
)
AZURE_REGIONS: tuple[str, ...] = (
    "australiacentral", "australiacentral2", "australiaeast", "australiasoutheast", "brazilsouth",
    "brazilsoutheast", "canadacentral", "canadaeast", "centralindia", "centralus", "chilecentral", "eastasia",
    "eastus", "eastus2", "francecentral", "francesouth", "germanynorth", "germanywestcentral",
    "indonesiacentral", "israelcentral", "italynorth", "japaneast", "japanwest", "jioindiacentral",
    "jioindiawest", "koreacentral", "koreasouth", "malaysiawest", "mexicocentral", "newzealandnorth",
    "northcentralus", "northeurope", "norwayeast", "norwaywest", "polandcentral", "qatarcentral",
    "southafricanorth", "southafricawest", "southcentralus", "southeastasia", "southindia", "spaincentral",
    "swedencentral", "swedensouth", "switzerlandnorth", "switzerlandwest", "uaecentral", "uaenorth", "uksouth",
    "ukwest", "westcentralus", "westeurope", "westindia", "westus", "westus2", "westus3",
)  # fmt: skip
"""Azure's region names (``location``), from :data:`REGIONS_SOURCE`."""


def nearest_regions(name: str, count: int = 3) -> list[str]:
    """The ``count`` known region names spelled most like ``name`` (``"westeuropa"`` -> ``westeurope`` first)."""
    ranked = sorted(AZURE_REGIONS, key=lambda r: -difflib.SequenceMatcher(None, name, r).ratio())
    return ranked[:count]
