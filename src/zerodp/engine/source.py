"""`zerodp.engine.source.ParameterSource` is the name zerodp.initialize's documentation gives for
`weights=`; the protocol lives with the rest of set-up, in engine/setup/source.py."""

from zerodp.engine.setup.source import ParameterSource

__all__ = ["ParameterSource"]
