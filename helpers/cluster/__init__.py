"""The cloud cluster: the Azure plan (azure), VM prices, time and cost estimates, the scaling model."""
