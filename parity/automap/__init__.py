"""Automatic weight mapping: a torch module's ``state_dict`` onto a Flax variable tree.

`parity.transfer.auto` pairs torch layers with Flax modules by rules, then names that agree, then the order in
which the layers run, then (where order leaves a choice) what they compute; it never pairs
layers by how their names sort, and raises with the candidates and a ``rules=`` line where
nothing decides. The layouts are `parity.pairs.layer_entries`' (Linear, ConvNd incl. grouped and
transposed, LayerNorm, RMSNorm, GroupNorm, BatchNorm with running statistics, Embedding,
LSTM/GRU gates, multi-head attention with fused or separate q/k/v, Hugging Face's ``Conv1D``);
tied weights map once. It returns a `parity.pairs.mapping.WeightMapping` and checks that torch ->
Flax -> torch gives every tensor back bit for bit. `parity.transfer.explain` shows each pair and how it
was decided; `parity.transfer.validate_variables` checks a transfer's result against the Flax module's own
initialisation before any training step.

Modules: `units` (torch units, Flax nodes, proposals), `execution` (call order on each side),
`function` (deciding by what layers compute), `core` (`auto`), `explain`, `validate`.
"""

# Public address: `parity.transfer` (auto, explain, format_explanation, validate_variables,
# TransferError); this package holds the implementation, one module per part.
__all__: list[str] = []
