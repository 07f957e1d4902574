"""Type aliases shared by the core: arrays of any array-API namespace are typed ``Any``."""

from typing import Any

Array = Any
