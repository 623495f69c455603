"""The local cloud's changes to moto, one module per AWS service (installed by sdflow.local.patching)."""
