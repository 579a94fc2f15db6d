"""Wire scalars shared by several message families, with their validation constraints."""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["Bytes20", "Bytes32", "Bytes64", "MultiaddrStr", "PeerIdStr", "RunIdStr", "Subkey", "ValueBytes"]

#: base58btc of an identity multihash of an Ed25519 key (see :mod:`protocols.peer_id`)
PeerIdStr = Annotated[str, msgspec.Meta(pattern=r"^[1-9A-HJ-NP-Za-km-z]{46,60}$")]
MultiaddrStr = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^/")]
RunIdStr = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._@:-]+$")]
Bytes20 = Annotated[bytes, msgspec.Meta(min_length=20, max_length=20)]
Bytes32 = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Bytes64 = Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)]
Subkey = Annotated[bytes, msgspec.Meta(max_length=256)]
ValueBytes = Annotated[bytes, msgspec.Meta(max_length=64 * 1024)]
