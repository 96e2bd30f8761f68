"""Model pairs: the adapters that run a torch module and a Flax module alike (`adapters`), the
weight mapping and its transforms (`mapping`, `variables`, `layer_entries`); automatic mapping
is `parity.automap`, the public entry point `parity.transfer`."""
