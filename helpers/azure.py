"""``python -m helpers.azure``: the Azure cluster command (:mod:`helpers.cluster.azure.command`)."""

from helpers.cluster.azure.command import cli

if __name__ == "__main__":
    raise SystemExit(cli())
