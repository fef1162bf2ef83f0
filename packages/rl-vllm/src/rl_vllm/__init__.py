"""vLLM generation workers (sync and async engines) with weight refit for rl.

Driver side: `rl_vllm.generation.VllmGeneration` (never imports vLLM). Worker side, in the
`vllm` environment's venv: `rl_vllm.worker.VllmGenerationWorker` and
`rl_vllm.worker.VllmAsyncGenerationWorker`.
"""

__version__ = "0.1.0"
