"""The pydantic base of every validated settings object: unknown fields are errors, and a failed
validation is one readable line rather than pydantic's multi-line report."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from blockfold.errors import BlockfoldError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def _resolve(self, name: str, value) -> None:
        """Fill field ``name`` with the default it resolves to, without counting it as given:
        ``model_fields_set`` (and so ``model_dump(exclude_unset=True)``) keeps naming only what the
        user set, so settings merged from a file and flags are resolved again, from scratch."""
        object.__setattr__(self, name, value)

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
