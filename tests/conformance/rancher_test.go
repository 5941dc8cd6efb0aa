package conformance

// Stand-ins for the parts of Rancher the Go module proxy does not serve here (see doc.go): the
// Store of later pkg/plan versions, the operations code's pause/cancel sync, the plan-secret
// controller's probes-passed stamp, and the checkpoint struct. Written for this suite from
// Rancher's documented behaviour (docs/rancher-keys.md); the plan content itself is Rancher's
// plan.Plan, encoded as Rancher encodes it (encoding/json).

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	rplan "github.com/rancher/rancher/pkg/plan"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
)

// Keys and annotations of a machine-plan Secret (docs/rancher-keys.md).
const (
	keyPlan             = "plan"
	keyCheckpoint       = "plan-checkpoint"
	keyProbeStatuses    = "probe-statuses"
	keyMaxFailures      = "max-failures"
	keyFailureThreshold = "failure-threshold"
	keyLastApplyTime    = "last-apply-time"
	keyAppliedPlan      = "appliedPlan"

	annWriter       = "plan.cattle.io/writer"
	annAttempt      = "plan.cattle.io/attempt"
	annPaused       = "plan.cattle.io/paused"
	annProbesPassed = "rke.cattle.io/plan-probes-passed"
	annLastUpdated  = "rke.cattle.io/plan-last-updated"

	secretTypeMachinePlan = "rke.cattle.io/machine-plan"

	// retryCooldown is Rancher's: a failed plan is set back to pending no sooner than this after
	// its last-apply-time.
	retryCooldown = 30 * time.Second
)

// planState is a plan-state value; the states, the cancel annotation and which states are
// terminal come from spelling_*_test.go, one file per spelling of cancel.
type planState string

// statePaused is written by the agent while a plan is held; no pkg/plan version names it yet.
const statePaused planState = "paused"

var knownStates = map[planState]bool{statePending: true, stateInProgress: true, stateSucceeded: true, stateFailed: true, statePaused: true, stateCanceled: true}

// checkpoint is the plan-checkpoint JSON as Rancher declares it: every field omitempty.
type checkpoint struct {
	Checksum              string    `json:"checksum,omitempty"`
	CompletedInstructions int       `json:"completedInstructions,omitempty"`
	TotalInstructions     int       `json:"totalInstructions,omitempty"`
	ResumeState           planState `json:"resumeState,omitempty"`
	Paused                bool      `json:"paused,omitempty"`
	TerminationIncomplete bool      `json:"terminationIncomplete,omitempty"`
}

// planStatus is what Rancher's Status reports about a Secret.
type planStatus struct {
	Secret       *corev1.Secret
	State        planState
	ProbesPassed bool
	Retrying     bool
}

func (p *planStatus) success() bool { return p.State == stateSucceeded && p.ProbesPassed }

func (p *planStatus) failure() bool {
	switch p.State {
	case statePending, stateInProgress, statePaused, stateSucceeded:
		return false
	case stateFailed:
		return !p.Retrying
	}
	return true
}

// store assigns, cancels and retries plans on machine-plan Secrets, as Rancher's Store does.
type store struct {
	secrets typedcorev1.SecretInterface
	// now is the clock the cooldown is measured with.
	now func() time.Time
	// writes counts the updates sent (a no-op must send none).
	writes int
}

func (s *store) update(secret *corev1.Secret) (*corev1.Secret, error) {
	s.writes++
	return s.secrets.Update(context.Background(), secret, metav1.UpdateOptions{})
}

func attemptOf(secret *corev1.Secret) (int, error) {
	raw := secret.Annotations[annAttempt]
	if raw == "" {
		return 1, nil
	}
	n, err := strconv.Atoi(raw)
	if err != nil {
		return 0, fmt.Errorf("%s %q: %w", annAttempt, raw, err)
	}
	return n, nil
}

func limit(secret *corev1.Secret, key string, def int) (int, error) {
	raw := string(secret.Data[key])
	if raw == "" {
		return def, nil
	}
	return strconv.Atoi(raw)
}

// setPending hands the plan to the agent afresh as the given attempt by writer: plan-state
// pending, the previous probe statuses dropped, probes-passed emptied.
func (s *store) setPending(secret *corev1.Secret, writer string, attempt int) {
	secret.Data[keyPlanState] = []byte(statePending)
	delete(secret.Data, keyProbeStatuses)
	secret.Annotations[annProbesPassed] = ""
	secret.Annotations[annLastUpdated] = s.now().UTC().Format(time.RFC3339)
	secret.Annotations[annAttempt] = strconv.Itoa(attempt)
	if writer == "" {
		delete(secret.Annotations, annWriter)
	} else {
		secret.Annotations[annWriter] = writer
	}
}

func prepared(secret *corev1.Secret) *corev1.Secret {
	secret = secret.DeepCopy()
	if secret.Data == nil {
		secret.Data = map[string][]byte{}
	}
	if secret.Annotations == nil {
		secret.Annotations = map[string]string{}
	}
	return secret
}

// assignPlan: new content or a new writer is a fresh assignment (pending, attempt 1, checkpoint
// cleared with an empty value, cancel removed, the failure limits written); the same content by
// the same writer is left alone and reported on, and a failed plan with attempts left is retried
// once the cooldown has passed since its last-apply-time.
func (s *store) assignPlan(secret *corev1.Secret, p *rplan.Plan, writer string, maxFailures, failureThreshold int) (*planStatus, error) {
	data, err := json.Marshal(p)
	if err != nil {
		return nil, err
	}
	secret = prepared(secret)
	if bytes.Equal(secret.Data[keyPlan], data) && secret.Annotations[annWriter] == writer {
		st, err := status(secret)
		if err != nil || st.State != stateFailed || !st.Retrying {
			return st, err
		}
		return s.retry(st, writer)
	}
	secret.Data[keyPlan] = data
	secret.Data[keyCheckpoint] = []byte{}
	delete(secret.Annotations, annCanceled)
	for key, v := range map[string]int{keyMaxFailures: maxFailures, keyFailureThreshold: failureThreshold} {
		if v > 0 || v == -1 {
			secret.Data[key] = []byte(strconv.Itoa(v))
		} else {
			delete(secret.Data, key)
		}
	}
	s.setPending(secret, writer, 1)
	updated, err := s.update(secret)
	if err != nil {
		return nil, err
	}
	return &planStatus{Secret: updated, State: statePending}, nil
}

func (s *store) retry(st *planStatus, writer string) (*planStatus, error) {
	now := s.now()
	last, err := time.Parse(time.UnixDate, string(st.Secret.Data[keyLastApplyTime]))
	if err == nil && !now.Before(last) && now.Before(last.Add(retryCooldown)) {
		return st, nil
	}
	attempt, err := attemptOf(st.Secret)
	if err != nil {
		return nil, err
	}
	secret := prepared(st.Secret)
	s.setPending(secret, writer, attempt+1)
	updated, err := s.update(secret)
	if err != nil {
		return nil, err
	}
	return &planStatus{Secret: updated, State: statePending, Retrying: true}, nil
}

// cancelPlan sets the cancel annotation (and the writer); a no-op when it is already "true".
func (s *store) cancelPlan(secret *corev1.Secret, writer string) (bool, *corev1.Secret, error) {
	if secret.Annotations[annCanceled] == "true" {
		return false, secret, nil
	}
	secret = prepared(secret)
	secret.Annotations[annCanceled] = "true"
	if writer != "" {
		secret.Annotations[annWriter] = writer
	}
	updated, err := s.update(secret)
	if err != nil {
		return false, secret, err
	}
	return true, updated, nil
}

// status reads the Secret as Rancher does, without acting on it.
func status(secret *corev1.Secret) (*planStatus, error) {
	st := &planStatus{Secret: secret, State: planState(secret.Data[keyPlanState])}
	attempt, err := attemptOf(secret)
	if err != nil {
		return nil, err
	}
	switch st.State {
	case statePending, stateInProgress:
		st.Retrying = attempt > 1
	case stateSucceeded:
		if secret.Annotations[annProbesPassed] != "" && len(secret.Data[keyProbeStatuses]) > 0 {
			_, healthy, err := parseProbeStatuses(secret.Data[keyProbeStatuses])
			if err != nil {
				return nil, err
			}
			st.ProbesPassed = healthy
		}
	case stateFailed:
		if secret.Annotations[annCanceled] == "true" {
			break
		}
		threshold, err := limit(secret, keyFailureThreshold, 1)
		if err != nil {
			return nil, err
		}
		maxFailures, err := limit(secret, keyMaxFailures, -1)
		if err != nil {
			return nil, err
		}
		st.Retrying = (threshold == -1 || attempt < threshold) && (maxFailures == -1 || attempt < maxFailures)
	}
	return st, nil
}

// parseProbeStatuses decodes probe-statuses into Rancher's plan.ProbeStatus; healthy when every
// entry is. Empty input is an error, as in Rancher.
func parseProbeStatuses(raw []byte) (map[string]rplan.ProbeStatus, bool, error) {
	if len(raw) == 0 {
		return nil, false, fmt.Errorf("probe status length was 0")
	}
	m := map[string]rplan.ProbeStatus{}
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, false, err
	}
	healthy := true
	for _, s := range m {
		healthy = healthy && s.Healthy
	}
	return m, healthy, nil
}

// planSecretController is the plan-secret controller's pass over a machine-plan Secret: it
// copies the plan to appliedPlan once applied-checksum is the plan's checksum, and stamps
// probes-passed (once per assignment: the Store empties it) when probe-statuses is present and
// every probe in it is healthy (an empty map, a plan without probes, is healthy).
func planSecretController(s *store, secret *corev1.Secret) (*corev1.Secret, error) {
	if secret.Type != secretTypeMachinePlan || len(secret.Data) == 0 {
		return secret, nil
	}
	changed := false
	out := prepared(secret)
	p := out.Data[keyPlan]
	if string(out.Data["applied-checksum"]) == rplan.Checksum(p) && !bytes.Equal(p, out.Data[keyAppliedPlan]) {
		out.Data[keyAppliedPlan] = p
		changed = true
	}
	if raw := out.Data[keyProbeStatuses]; len(raw) > 0 {
		_, healthy, err := parseProbeStatuses(raw)
		if err != nil {
			return secret, err
		}
		if healthy && out.Annotations[annProbesPassed] == "" {
			out.Annotations[annProbesPassed] = s.now().UTC().Format(time.RFC3339)
			changed = true
		}
	}
	if !changed {
		return secret, nil
	}
	return s.update(out)
}

// syncOperation is the operations code's sync of an Operation's spec onto a machine-plan
// Secret: a cancel sets canceled "true" and clears the pause in the same write; a pause sets
// paused "true"; either is cleared by removing its key.
func syncOperation(s *store, secret *corev1.Secret, paused, canceled bool) (*corev1.Secret, error) {
	secret = prepared(secret)
	if canceled {
		secret.Annotations[annCanceled] = "true"
		delete(secret.Annotations, annPaused)
	} else {
		delete(secret.Annotations, annCanceled)
		if paused {
			secret.Annotations[annPaused] = "true"
		} else {
			delete(secret.Annotations, annPaused)
		}
	}
	return s.update(secret)
}
