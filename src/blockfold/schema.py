"""The pydantic base of every validated settings object: unknown fields are errors, and a failed
validation is one readable line rather than pydantic's multi-line report."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from blockfold.errors import BlockfoldError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @classmethod
    def parse(cls, data, origin: str = "recipe"):
        """Validate a plain dict, turning pydantic's report into one readable line."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise BlockfoldError(f"invalid {origin}: {describe(err)}") from None


def describe(err: ValidationError) -> str:
    """``field.path: message; ...`` for every problem pydantic found."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'recipe'}: {e['msg'].removeprefix('Value error, ')}"
                     for e in err.errors())
