"""Privacy mode on the API's side: the `X-Tabloop-No-Train` header and marking a completion
request `no_train` (the rules themselves: tabloop/core/privacy.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header

from service.completions.schemas import CompleteRequest
from tabloop.core.keys import ApiKey
from tabloop.core.privacy import NO_TRAIN_HEADER, parse_no_train


async def _no_train_header(
    value: Annotated[
        str,
        Header(
            alias=NO_TRAIN_HEADER,
            pattern=r"^\s*(?i:1|0|true|false|yes|no|on|off)\s*$",
            description="Privacy mode for this request: `1` stores none of its code and never "
            "trains on it (docs/PRIVACY.md). A key made with `no_train` is always in it.",
        ),
    ] = "",  # not None: a header is never null, and the schema says so
) -> bool:
    return parse_no_train(value or None)  # "": not sent (a sent empty value fails the pattern)


NoTrainHeader = Annotated[bool, Depends(_no_train_header)]


def in_privacy_mode(req: CompleteRequest, key: ApiKey, header: bool) -> CompleteRequest:
    """The request, marked `no_train` when its key, its header or its body asks for it. Nothing
    turns it off again: a `0` header does not override a `no_train` key."""
    if req.no_train or not (key.no_train or header):
        return req
    return req.model_copy(update={"no_train": True})
