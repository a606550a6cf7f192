"""The base of every config section and the error users see: shared by the config modules."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigError", "Section"]


class ConfigError(ValueError):
    """A user-facing configuration mistake; the message names the dotted key and the fix."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
