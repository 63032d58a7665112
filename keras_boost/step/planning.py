"""The boost step's Python-side planning: which branch the next steps train, and for how many.

Read between steps from the stages' state (the `select_branch` owner's sequence, the `window`
owner's micro-step), so it follows a restored or re-formed run and is identical on every
worker. The train function (`keras_boost.step.dispatch`) and self-measurement
(`keras_boost.step.tuning`) ask it; `BoostStep` has it as a base.
"""


class BranchPlanning:
    """What `BoostStep` says about its coming steps (it needs `_with`, `_groups` and `_require_built`)."""

    def branching(self):
        """The stage that chooses each step's branch (`select_branch`: gradient freezing), or None."""
        selecting = self._with("select_branch")
        return selecting[0] if selecting else None

    def plans_branches(self):
        """Whether the branch of each step can be chosen from Python (`next_branch`)."""
        self._require_built()
        return len(self._groups) > 1 and self._with("select_branch")[0].upcoming_branch() is not None

    def window_left(self):
        """(micro-batches left in the open accumulation window, per window), read between steps;
        (1, 1) without a window stage, None where the window cannot say."""
        windowing = self._with("window")
        return windowing[0].steps_to_boundary() if windowing else (1, 1)

    def at_window_boundary(self):
        """Whether no accumulation window is open (True where the window cannot say)."""
        window = self.window_left()
        return window is None or window[0] == window[1]

    def next_branch(self, limit):
        """(branch, steps): the branch the next step trains, and for how many steps in a row (1..limit).

        Read from the state variables between steps, so it follows a restored or re-formed
        run; identical on every worker, whose state is identical.
        """
        branch, updates = self._with("select_branch")[0].upcoming_branch()
        window = self.window_left()
        if window is None:  # a window that cannot say where it ends: one step at a time
            return branch, 1
        first, per_update = window
        return branch, max(1, min(limit, first + (updates - 1) * per_update))

    def branches_ahead(self):
        """The branches the coming updates train, each once, in the order they first come (Python ints)."""
        return self._with("select_branch")[0].branches_ahead()
