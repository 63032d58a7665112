# Sourced by setup.sh, test.sh and demo.sh (after ROOT is set): the TensorFlow asked for and its venv.
# TF_VERSION picks the TensorFlow (default: keras_boost/_versions.py's DEFAULT_TENSORFLOW, the newest
# on which the suite passes). The default's environment is .venv; another version's is .venv-tfVERSION,
# so that versions sit side by side and switching between them reinstalls nothing.
# KERAS_BOOST_VENV names another folder.
DEFAULT_TF_VERSION="$(python3 "$ROOT/keras_boost/_versions.py" default)"
TF_VERSION="${TF_VERSION:-$DEFAULT_TF_VERSION}"
if [ "$TF_VERSION" = "$DEFAULT_TF_VERSION" ]; then
  VENV="${KERAS_BOOST_VENV:-$ROOT/.venv}"
else
  VENV="${KERAS_BOOST_VENV:-$ROOT/.venv-tf$TF_VERSION}"
fi
