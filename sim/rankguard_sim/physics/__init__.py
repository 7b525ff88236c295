"""The sandbox world's ground truth, never the operator's model of it: the simulated GPUs
(`gpus`), the scenarios that say what each rank really holds (`scenario_file` reads
scenarios/*.yaml into `scenario_data`), and vLLM's memory over them (`engine_config`,
`engine_memory`, `engine_failures`, `engine_outcome`; `checkpoint_tensors` for the checkpoint's
own headers). Every figure cites the published measurement it comes from."""
