"""What a run is, below everything that runs, judges or reports one: the run configuration
(`config`), the precision recipes and their registry (`recipes`, with torchao's fp8 conversion in
`fp8`), the task losses (`losses`), the run record and its schema (`records`, `schema`,
`eval_logits`), the machine it ran on (`hardware`), and the plain functions through which the
command line's forms reach lower layers (`flags`: the arguments that reproduce a config;
`progress`: progress lines). Imports no trainer, verdict, report or command-line module."""
