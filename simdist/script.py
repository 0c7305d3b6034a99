"""Load a script's entry function by path: the convention shared by ``simdist run`` and ``python -m real``.

Defined in ``simdist_base.script``, importable without the simulator, since ``python -m real`` loads
scripts on machines that have only torch; this module is its public name.
"""

from simdist_base.script import (
    SCRIPT_MODULE_PREFIX,
    ScriptError,
    load_entry,
    script_module_name,
    script_path_of,
    user_traceback,
)

__all__ = [
    "SCRIPT_MODULE_PREFIX",
    "ScriptError",
    "load_entry",
    "script_module_name",
    "script_path_of",
    "user_traceback",
]
