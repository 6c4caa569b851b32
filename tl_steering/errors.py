"""One error hierarchy for tl_steering.

Every message says what is wrong and what to do about it. Each class also derives from the closest builtin
exception so that ``except ValueError`` style code written against TransformerLens keeps working."""


class TLSteeringError(Exception):
    """Base class of every error raised on purpose by tl_steering."""


class ModelNotSupportedError(TLSteeringError, TypeError):
    """The object is not a TransformerLens model this package can drive (or the backend is unavailable)."""


class ModelLoadError(TLSteeringError, RuntimeError):
    """A model could not be loaded (missing offline package, hub unreachable, unknown name)."""


class HookNotFoundError(TLSteeringError, LookupError):
    """A hook point does not exist on the model, or exists but never fires."""

    def __str__(self) -> str:  # LookupError subclasses like KeyError would quote the message; keep it plain
        return str(self.args[0]) if self.args else ""


class ParallelBlockError(TLSteeringError, ValueError):
    """A sequential-only site (resid_mid, mlp_in swap) was asked for on a parallel attention/MLP block."""


class LayerIndexError(TLSteeringError, IndexError):
    """A layer index is out of range for the model."""


class InputError(TLSteeringError, ValueError):
    """Bad tokens or arguments: empty batch, sequence too short, wrong dtype, bad option value."""


class ArgumentTypeError(InputError, TypeError):
    """An argument has the wrong type (a string or float where layer ints are expected, None where a value is
    required); raised by :mod:`tl_steering.validation` with the argument's name."""


class DeviceMismatchError(InputError):
    """Tokens or tensors live on another device than the model."""


class DeviceUnavailableError(InputError):
    """A device was asked for that this machine does not have (``"cuda"`` without a GPU); raised before any
    model is loaded."""


class ResultFileError(InputError):
    """A result file cannot be read back: truncated or corrupted, unknown kind or format version, missing,
    unknown or wrong-typed fields. The message names the file and the field."""


class ModelBusyError(TLSteeringError, RuntimeError):
    """Another thread's tl_steering call is using this model (docs/hooks.md, "One caller per model"): the message
    names that call and its thread. Wait for it, or give each thread its own model."""


class NonFiniteError(TLSteeringError, FloatingPointError):
    """NaN or Inf met in an activation; the message names the layer and the site."""


class ResidualIdentityError(TLSteeringError, RuntimeError):
    """resid_pre + attn_out (+ mlp_out) does not reproduce the next residual: the model's hooks are not what
    the decomposition assumes (a known class of TransformerBridge bugs), so no number would be trustworthy."""


class UserHooksWarning(UserWarning):
    """A result was measured with hooks on the model that tl_steering did not make (the user's own): the numbers
    describe the model as those hooks change it. Silence it with
    ``warnings.filterwarnings("ignore", category=tl_steering.errors.UserHooksWarning)``."""


__all__ = [
    "TLSteeringError", "UserHooksWarning", "ModelNotSupportedError", "ModelLoadError", "HookNotFoundError",
    "ParallelBlockError", "LayerIndexError", "InputError", "ArgumentTypeError", "DeviceMismatchError",
    "DeviceUnavailableError", "ResultFileError", "ModelBusyError", "NonFiniteError", "ResidualIdentityError"]
