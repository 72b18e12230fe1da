"""The server's sampling fields read from a request (k26/server/sampling_api.py), unit by unit (the HTTP error
paths are in test_server_errors.py)."""

import pytest

from k26.server.errors import APIError
from k26.server.sampling_api import _logit_bias


def test_logit_bias_keys_are_token_ids_whatever_their_leading_zeros():
    # (found in an audit: "0005" was token 5 but "00005" was "not a token id": the length check came first)
    assert _logit_bias({"0005": 1, "000": -2}, 100) == ((5, 1.0), (0, -2.0))
    assert _logit_bias({"0" * 5000 + "7": 3}, 100) == ((7, 3.0),)
    for bad in ({"00100": 1}, {"": 1}, {"05": 1, "5": 2}):
        with pytest.raises(APIError):
            _logit_bias(bad, 100)
