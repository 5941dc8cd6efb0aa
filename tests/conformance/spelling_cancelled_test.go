//go:build cancelled

package conformance

// The May 2026 spelling, two "l"s: Rancher's pkg/plan v0.0.0-20260508124826-0b6b24d9811e (the
// version system-agent's main pins), built with go.cancelled.mod:
//
//	go test -modfile=go.cancelled.mod -tags cancelled .
//
// The states, the plan-state key and which states are terminal are that module's own; the
// annotation is named only in its comment on PlanStateCancelled.
import rplan "github.com/rancher/rancher/pkg/plan"

const (
	keyPlanState = rplan.PlanStateKey
	annCanceled  = "plan.cattle.io/cancelled"

	statePending    = planState(rplan.PlanStatePending)
	stateInProgress = planState(rplan.PlanStateInProgress)
	stateSucceeded  = planState(rplan.PlanStateSucceeded)
	stateFailed     = planState(rplan.PlanStateFailed)
	stateCanceled   = planState(rplan.PlanStateCancelled)
)

func (s planState) terminal() bool { return rplan.PlanState(s).IsTerminal() }
