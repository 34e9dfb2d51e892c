"""The Tinker service's protobuf wire format against the `tinker` SDK's own encoders and decoders:
a forward_backward body the SDK encodes becomes the trainer's datums, and the results the service
writes decode with the SDK's readers into what was meant."""

from __future__ import annotations

import numpy as np
import pytest

from tandem_inference.errors import TinkerInvalid

tinker = pytest.importorskip("tinker")
from tinker import types as tt  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (  # noqa: E402
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from tandem_inference.tinker import wire  # noqa: E402

pytestmark = pytest.mark.unit


def encoded(data: list[tt.Datum], loss_fn: str = "cross_entropy", **config: float) -> bytes:
    request = tt.ForwardBackwardRequest(
        forward_backward_input=tt.ForwardBackwardInput(data=data, loss_fn=loss_fn,  # type: ignore[arg-type]
                                                       loss_fn_config=config or None),
        model_id="m", seq_id=3)
    return bytes(forward_backward_request_to_proto(request).SerializeToString())


def test_the_sdks_forward_backward_becomes_the_trainers_datums() -> None:
    datum = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2, 3]),
                     loss_fn_inputs={"target_tokens": [2, 3, 4], "advantages": [0.5, -1.0, 0.0],
                                     "logprobs": [-1.0, -2.0, -3.0]})
    model_id, seq, loss, config, datums, forward_only = wire.parse_forward_backward(
        encoded([datum], "ppo", clip_low_threshold=0.8))
    assert (model_id, seq, loss, forward_only) == ("m", 3, "ppo", False)
    assert config == {"clip_low_threshold": pytest.approx(0.8)}
    assert datums[0].tokens == [1, 2, 3]
    assert datums[0].inputs == {"target_tokens": [2.0, 3.0, 4.0], "advantages": [0.5, -1.0, 0.0],
                                "logprobs": [-1.0, -2.0, -3.0]}


@pytest.mark.parametrize(("inputs", "words"), [
    ({"target_tokens": [2, 3]}, "2 values for 3 tokens"),
    ({"weights": [1.0, 1.0, 1.0]}, "no target_tokens"),
    ({"target_tokens": [2, 3, 4], "weights": [1.0, float("nan"), 1.0]}, "not finite"),
])
def test_datums_the_trainer_cannot_take_are_refused_naming_the_input(inputs: dict[str, list[float]],
                                                                     words: str) -> None:
    datum = tt.Datum(model_input=tt.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs=inputs)  # type: ignore[arg-type]
    with pytest.raises(TinkerInvalid, match=words):
        wire.parse_forward_backward(encoded([datum]))


def test_garbage_and_unknown_losses_are_refused() -> None:
    with pytest.raises(TinkerInvalid, match="ForwardBackwardRequest"):
        wire.parse_forward_backward(b"\xff\xff\xff")
    datum = tt.Datum(model_input=tt.ModelInput.from_ints([1]), loss_fn_inputs={"target_tokens": [2]})
    with pytest.raises(TinkerInvalid, match="stable_reinforce"):
        wire.parse_forward_backward(encoded([datum], "stable_reinforce"))


def test_forward_backward_output_decodes_with_the_sdk() -> None:
    out = deserialize_forward_backward_output(wire.forward_backward_output(
        [{"logprobs": [-1.0, -2.0]}, {"logprobs": [-0.5, -0.25, -4.0]}], {"loss:sum": 7.75}))
    assert out.metrics == {"loss:sum": 7.75}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-0.5, -0.25, -4.0]]


def test_sample_response_decodes_with_the_sdk() -> None:
    got = deserialize_sample_response(wire.sample_response([([5, 6, 7], [-0.1, -0.2, -0.3], "length"),
                                                            ([9], [-1.5], "stop")]))
    assert [s.tokens for s in got.sequences] == [[5, 6, 7], [9]]
    assert [s.stop_reason for s in got.sequences] == ["length", "stop"]
    assert np.allclose(got.sequences[0].logprobs, [-0.1, -0.2, -0.3])


def test_zstd_is_read_within_the_limit_and_other_encodings_refused() -> None:
    import zstandard

    body = zstandard.ZstdCompressor().compress(b"x" * 5000)
    assert wire.decompress(body, "zstd", 10_000) == b"x" * 5000
    with pytest.raises(TinkerInvalid, match="inflates past 1000 bytes"):
        wire.decompress(body, "zstd", 1000)
    with pytest.raises(TinkerInvalid, match="not zstd"):
        wire.decompress(b"plain", "zstd", 1000)
    with pytest.raises(TinkerInvalid, match="gzip"):
        wire.decompress(b"", "gzip", 1000)
