"""Hard bounds of the wire protocol (docs/protocol.md section 5).

Every bound is enforced by the typed decoder while it reads a frame, before
anything proportional to an attacker-chosen length is allocated.
"""

from __future__ import annotations

from typing import Final

MAX_FRAME_BYTES: Final = 64 * 1024 * 1024
MAX_ITEMS: Final = 65_536
MIN_KEY_BYTES: Final = 1
MAX_KEY_BYTES: Final = 256
MAX_NAME_CHARS: Final = 512
MAX_FINGERPRINT_CHARS: Final = 128
MAX_AGENT_METADATA_BYTES: Final = 16 * 1024 * 1024
INT_LIMIT: Final = 2**63  # exclusive upper bound of every wire integer
BOOT_ID_BYTES: Final = 16
MAX_TRANSPORTS: Final = 8
MAX_TRANSPORT_FIELDS: Final = 32
MAX_TRANSPORT_NAME_CHARS: Final = 32
MAX_TRANSPORT_VALUE_BYTES: Final = 4096
MAX_TYPE_CHARS: Final = 64
#: Tokens of one prefetch's prompt prefix (4 MiB of msgpack at most).
MAX_PREFETCH_TOKENS: Final = 1_048_576
