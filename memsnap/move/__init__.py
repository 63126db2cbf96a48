"""Moving a running job between daemons. facade.Mover is the entry point; see its docstring for the
modules (plan, stream, target, lazy, network) and their order."""

from memsnap.move.facade import Mover

__all__ = ["Mover"]
