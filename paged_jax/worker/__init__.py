"""Device side of one engine step: InputBatch packs the scheduler's decisions into a
fixed-shape StepInput (numpy), Runner runs the jitted step, sampling picks tokens.

Mirrors vLLM V1's ``v1/worker``. ``input_batch`` and what it builds with
(``block_table``, ``step_input``) are numpy only; ``runner``,
``sampling`` and ``sharding`` import jax.
"""
