"""Pipeline schedules as data: actions, generators, lowering, validator and lockstep simulator.

A schedule is one list of actions per **stage** (every TP rank of a stage runs the same list),
indexed by stage. The modules, in data-flow order:

- ``ir``: ``Kind``, ``Direction``, ``Action`` and its compact reversible string form (``F3``, ``SEND_B0.2``),
  the grid printer;
- ``generators``: ``gpipe``, ``one_f_one_b``, ``interleaved_1f1b``, ``zero_bubble_h1``, pure functions that
  emit compute-only schedules (``F``/``B``, or ``F``/``I``/``W``);
- ``lowering``: ``lower`` adds the communication (``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``), ``build`` is
  generator + lowering;
- ``dependencies``: ``requirements``/``produces``/``peer``, the one statement of the semantics below;
- ``validator``: ``validate`` checks a schedule statically and then runs all stages in a lockstep
  simulation to find deadlocks. Errors carry the schedule grid with the failing step marked
  ``<-- ERROR HERE``;
- ``files``: ``load_schedule_file`` reads a user-written schedule (text or CSV).

Chunks (interleaved, "virtual" stages): with ``chunks`` model chunks per stage, chunk c of stage s
is virtual stage ``v = c * num_stages + s``, and data flows through virtual stages in order. So the
last stage's chunk c sends forward to stage 0's chunk c + 1 (the *wrap*), and backward the reverse.
The number of chunks of a schedule is ``1 + its largest chunk index`` (``num_chunks``); a schedule
whose actions are all chunk 0 is an ordinary linear pipeline.

Semantics (the runtime implements exactly these):

- ``SEND`` is non-blocking; ``RECV`` blocks until the neighbouring virtual stage has issued the
  matching ``SEND`` (``SEND_F m.c`` on virtual stage v-1 -> ``RECV_F m.c'`` on v;
  ``SEND_B`` on v+1 -> ``RECV_B`` on v; same microbatch; ``peer`` gives the exact match).
- A backward is either one ``B m`` (input and weight gradients) or split in two (zero-bubble):
  ``I m`` computes only the input gradient, which the previous stage waits for, and ``W m`` the
  weight gradient, which nobody waits for and so can fill a bubble. "The input gradient of m" is
  the event ``I m``; a ``B m`` produces it too.
- ``F m`` needs ``RECV_F m`` earlier on its stage unless it is the first virtual stage; ``B m`` and
  ``I m`` need ``F m`` and, unless it is the last virtual stage, ``RECV_B m``; ``SEND_F m`` needs
  ``F m``; ``SEND_B m`` and ``W m`` need the input gradient ``I m`` (all same chunk).
- A schedule without any communication action is read as compute-only: the data dependency is
  then direct (``F m`` on v needs ``F m`` on v-1; ``B m`` or ``I m`` on v needs the input gradient
  of m on v+1), so generator output can be validated before lowering.

Pure standard library + attrs: no torch, so planning, dry runs and tests run anywhere.
"""

from hetero_llm.schedule.dependencies import peer, produces, requirements
from hetero_llm.schedule.files import load_schedule_file
from hetero_llm.schedule.generators import compute_schedule, gpipe, interleaved_1f1b, one_f_one_b, zero_bubble_h1
from hetero_llm.schedule.ir import (
    BACKWARD_KINDS,
    COMM_KINDS,
    COMPUTE_KINDS,
    OPTIMIZER_KINDS,
    Action,
    ActionLists,
    Direction,
    Event,
    Kind,
    format_actions,
    format_grid,
    num_chunks,
    parse_actions,
)
from hetero_llm.schedule.lowering import add_optimizer_actions, build, lower
from hetero_llm.schedule.validator import check_message_order, simulate_order, validate

__all__ = [
    "BACKWARD_KINDS",
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "OPTIMIZER_KINDS",
    "Action",
    "ActionLists",
    "Direction",
    "Event",
    "Kind",
    "add_optimizer_actions",
    "build",
    "check_message_order",
    "compute_schedule",
    "format_actions",
    "format_grid",
    "gpipe",
    "interleaved_1f1b",
    "load_schedule_file",
    "lower",
    "num_chunks",
    "one_f_one_b",
    "parse_actions",
    "peer",
    "produces",
    "requirements",
    "simulate_order",
    "validate",
    "zero_bubble_h1",
]
