"""Pipeline parallelism: schedules (data), their simulator, the partition of layers into stages,
the runtime that executes a schedule inside a model's forward, and the contract a model meets to be
pipelined (:class:`LayerSequence`: give a model a ``pipeline_sequence()`` method returning one)."""

from lightning_3d.pipeline.sequences import HeadOutput, Inputs, LayerSequence

__all__ = ["HeadOutput", "Inputs", "LayerSequence"]
