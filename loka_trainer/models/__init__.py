"""Model zoo (DLRM dot / DCNv2, Wukong, InterFormer) with the LoKA Mods switches.

Entry point: ``loka_trainer.models.zoo.build_model(model_cfg, *, schema, loka_mods)`` and its ``MODELS``
registry; config schemas in ``configs`` (importable without TorchRec).
"""
