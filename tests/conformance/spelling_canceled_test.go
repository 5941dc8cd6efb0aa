//go:build !cancelled

package conformance

// The newest spelling, one "l" in both the state and the annotation: Rancher's pkg/plan after
// v0.0.0-20260508124826-0b6b24d9811e (state.go: PlanStateCanceled = "canceled"). The proxy does
// not serve such a version here, so the values are written out; go.mod's pkg/plan (April 2026)
// has no plan states at all.
const (
	keyPlanState = "plan-state"
	annCanceled  = "plan.cattle.io/canceled"

	statePending    planState = "pending"
	stateInProgress planState = "in-progress"
	stateSucceeded  planState = "succeeded"
	stateFailed     planState = "failed"
	stateCanceled   planState = "canceled"
)

func (s planState) terminal() bool {
	return s == stateSucceeded || s == stateFailed || s == stateCanceled
}
