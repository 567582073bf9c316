"""Which FSDP wrapping the trainer picks for a model."""

from services.trainer.spec import SHARD_LAYERS_ABOVE_PARAMS, TrainerSpec, shards_layers


def test_small_models_shard_only_the_root_and_large_ones_every_layer() -> None:
    auto = TrainerSpec()
    assert not shards_layers(auto, 100_000)
    assert shards_layers(auto, SHARD_LAYERS_ABOVE_PARAMS + 1)


def test_an_explicit_choice_wins_over_the_size() -> None:
    assert shards_layers(TrainerSpec(shard_layers=True), 100_000)
    assert not shards_layers(TrainerSpec(shard_layers=False), 10 * SHARD_LAYERS_ABOVE_PARAMS)
