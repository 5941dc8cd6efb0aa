package conformance

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	rplan "github.com/rancher/rancher/pkg/plan"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// guard bounds every wait on the agent (a hang guard, not a pace): the retry scenario waits out
// Rancher's 30 s cooldown inside it.
const guard = 90 * time.Second

var (
	agentBin  string
	cp        *controlPlane
	clientset *kubernetes.Clientset
	nsCounter atomic.Int64
)

// skipReason is why the suite skips (its test reports it as a skip), empty when it runs.
var skipReason string

// skipOrFail is the loud skip outside CI (a line, and the test reported as skipped), a failure
// with NODEPLAN_CI set.
func skipOrFail(m *testing.M, why string) int {
	if os.Getenv("NODEPLAN_CI") != "" {
		fmt.Fprintf(os.Stderr, "FAIL: NODEPLAN_CI is set, so the conformance suite must not skip: %s\n", why)
		return 1
	}
	fmt.Fprintf(os.Stderr, "*** SKIPPED the Rancher conformance suite: %s ***\n", why)
	skipReason = why
	return m.Run()
}

func TestMain(m *testing.M) {
	os.Exit(testMain(m))
}

func testMain(m *testing.M) int {
	agentBin = os.Getenv("NODEPLAN_BIN")
	if agentBin == "" {
		agentBin = "../../target/debug/nodeplan"
	}
	if abs, err := filepath.Abs(agentBin); err == nil {
		agentBin = abs
	}
	if _, err := os.Stat(agentBin); err != nil {
		return skipOrFail(m, fmt.Sprintf("no agent binary at %s (set NODEPLAN_BIN, or cargo build)", agentBin))
	}
	bin := os.Getenv("NODEPLAN_K8S_BIN")
	if bin == "" {
		bin = "/var/tmp/nodeplan-k8s/bin"
	}
	for _, b := range []string{"etcd", "kube-apiserver"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			return skipOrFail(m, fmt.Sprintf("no %s in %s (set NODEPLAN_K8S_BIN; build with tools/build-kube-apiserver.sh)", b, bin))
		}
	}
	t0 := time.Now()
	var err error
	cp, err = startControlPlane(bin)
	if err != nil {
		if cp != nil {
			cp.stop()
		}
		fmt.Fprintf(os.Stderr, "FAIL: %v\n", err)
		return 1
	}
	defer cp.stop()
	fmt.Fprintf(os.Stderr, "conformance: kube-apiserver %s from %s ready in %v; agent %s\n", cp.version, bin, time.Since(t0).Round(time.Millisecond), agentBin)
	if clientset, err = cp.clientset(); err != nil {
		fmt.Fprintf(os.Stderr, "FAIL: client: %v\n", err)
		return 1
	}
	return m.Run()
}

// machine is one node's machine-plan Secret, the agent watching it, and Rancher's Store over it.
type machine struct {
	t     *testing.T
	node  *node
	store *store
	ns    string
	name  string
}

// newMachine creates a namespace, the machine-plan Secret as Rancher creates it (no plan yet;
// probe-period-seconds 1 to keep the probe loop quick), and starts the agent on it.
func newMachine(t *testing.T) *machine {
	t.Helper()
	ns := fmt.Sprintf("conf-%d-%d", os.Getpid(), nsCounter.Add(1))
	ctx := context.Background()
	if _, err := clientset.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("namespace: %v", err)
	}
	secrets := clientset.CoreV1().Secrets(ns)
	sec := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "machine-plan"},
		Type:       secretTypeMachinePlan,
		Data:       map[string][]byte{"probe-period-seconds": []byte("1")},
	}
	if _, err := secrets.Create(ctx, sec, metav1.CreateOptions{}); err != nil {
		t.Fatalf("secret: %v", err)
	}
	m := &machine{t: t, node: newNode(t, cp, ns, "machine-plan"), store: &store{secrets: secrets, now: time.Now}, ns: ns, name: "machine-plan"}
	m.node.start(t)
	return m
}

func (m *machine) get() *corev1.Secret {
	m.t.Helper()
	s, err := m.store.secrets.Get(context.Background(), m.name, metav1.GetOptions{})
	if err != nil {
		m.t.Fatalf("get secret: %v", err)
	}
	return s
}

// wait polls the Secret (every 50 ms, bounded by guard) until pred holds.
func (m *machine) wait(what string, pred func(*corev1.Secret) bool) *corev1.Secret {
	m.t.Helper()
	deadline := time.Now().Add(guard)
	for {
		s := m.get()
		if pred(s) {
			return s
		}
		if time.Now().After(deadline) {
			m.t.Fatalf("the Secret never got %s within %v: %s", what, guard, describe(s))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func describe(s *corev1.Secret) string {
	var b strings.Builder
	fmt.Fprintf(&b, "rv %s annotations %v;", s.ResourceVersion, s.Annotations)
	for k, v := range s.Data {
		switch k {
		case "plan", "applied-output", "failed-output", "applied-periodic-output":
			fmt.Fprintf(&b, " %s=(%d bytes)", k, len(v))
		default:
			fmt.Fprintf(&b, " %s=%q", k, v)
		}
	}
	return b.String()
}

// onFresh runs a write of Rancher's on the Secret as it is now, again on a conflict with a
// write of the agent's (as Rancher's controllers requeue), bounded by guard.
func (m *machine) onFresh(what string, write func(*corev1.Secret) error) {
	m.t.Helper()
	deadline := time.Now().Add(guard)
	for {
		err := write(m.get())
		if err == nil {
			return
		}
		if !apierrors.IsConflict(err) || time.Now().After(deadline) {
			m.t.Fatalf("%s: %v", what, err)
		}
	}
}

func (m *machine) assign(p *rplan.Plan, writer string, maxFailures, failureThreshold int) *planStatus {
	m.t.Helper()
	var st *planStatus
	m.onFresh("AssignPlan", func(s *corev1.Secret) (err error) {
		st, err = m.store.assignPlan(s, p, writer, maxFailures, failureThreshold)
		return err
	})
	return st
}

// syncOperation writes an Operation's pause/cancel onto the Secret (see syncOperation).
func (m *machine) syncOperation(paused, canceled bool) {
	m.t.Helper()
	m.onFresh("operations sync", func(s *corev1.Secret) error {
		_, err := syncOperation(m.store, s, paused, canceled)
		return err
	})
}

// reconcile is one pass of Rancher's reconcile over the machine, until done says stop: the
// plan-secret controller stamps probes-passed, then AssignPlan with the same plan and writer
// reports on it (and retries a failed plan once the cooldown has passed). Bounded by guard.
func (m *machine) reconcile(p *rplan.Plan, writer string, maxFailures, failureThreshold int, done func(*planStatus) bool) *planStatus {
	m.t.Helper()
	deadline := time.Now().Add(guard)
	for {
		s, err := planSecretController(m.store, m.get())
		var st *planStatus
		if err == nil {
			st, err = m.store.assignPlan(s, p, writer, maxFailures, failureThreshold)
		}
		switch {
		case apierrors.IsConflict(err):
			// The agent wrote meanwhile: the next pass sees its write.
			if time.Now().After(deadline) {
				m.t.Fatalf("reconcile: conflicts until the guard ran out: %v", err)
			}
			continue
		case err != nil:
			m.t.Fatalf("reconcile: %v", err)
		case done(st):
			return st
		}
		if time.Now().After(deadline) {
			m.t.Fatalf("Rancher's reconcile never got there within %v: state %q probesPassed %v retrying %v: %s",
				guard, st.State, st.ProbesPassed, st.Retrying, describe(st.Secret))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func settled(st *planStatus) bool { return st.success() || st.failure() }

// waitFile waits (bounded) for a file an instruction creates.
func (m *machine) waitFile(path string) {
	m.t.Helper()
	deadline := time.Now().Add(guard)
	for {
		if _, err := os.Stat(path); err == nil {
			return
		}
		if time.Now().After(deadline) {
			m.t.Fatalf("%s never appeared: %s", path, describe(m.get()))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func lines(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return strings.Fields(string(b))
}

func sh(name, script string, saveOutput bool) rplan.OneTimeInstruction {
	return rplan.OneTimeInstruction{
		CommonInstruction: rplan.CommonInstruction{Name: name, Command: "sh", Args: []string{"-c", script}},
		SaveOutput:        saveOutput,
	}
}

// annotationsAsRancherLeftThem checks plan.cattle.io/writer and /attempt still say what Rancher
// wrote last.
func annotationsAsRancherLeftThem(t *testing.T, s *corev1.Secret, writer, attempt string) {
	t.Helper()
	if got := s.Annotations[annWriter]; got != writer {
		t.Errorf("%s = %q, Rancher wrote %q", annWriter, got, writer)
	}
	if got := s.Annotations[annAttempt]; got != attempt {
		t.Errorf("%s = %q, Rancher wrote %q", annAttempt, got, attempt)
	}
}

func TestRancherConformance(t *testing.T) {
	if skipReason != "" {
		t.Skipf("*** SKIPPED: %s ***", skipReason)
	}
	t.Run("the checks see a foreign write", func(t *testing.T) {
		t.Parallel()
		// checkAgentWrites must be able to fail: another field manager writing Rancher's
		// annotation and key, and a key of the agent's Rancher cannot read, are reported.
		m := newMachine(t)
		m.assign(&rplan.Plan{}, "writer-a", 1, 1)
		cfg := cp.restConfig()
		cfg.UserAgent = "not-rancher"
		other, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			t.Fatal(err)
		}
		patch := []byte(`{"metadata":{"annotations":{"plan.cattle.io/attempt":"7"}},"data":{"max-failures":"OQ==","plan-checkpoint":"e30K","last-apply-time":"bm93"}}`)
		s, err := other.CoreV1().Secrets(m.ns).Patch(context.Background(), m.name, types.MergePatchType, patch, metav1.PatchOptions{})
		if err != nil {
			t.Fatal(err)
		}
		problems, _ := agentWriteProblems(s)
		want := []string{"wrote annotation plan.cattle.io/attempt", "wrote Rancher's key max-failures", `key "last-apply-time" cannot be read`}
		for _, w := range want {
			found := false
			for _, p := range problems {
				found = found || strings.Contains(p, w)
			}
			if !found {
				t.Errorf("checkAgentWrites misses %q; it reported %q", w, problems)
			}
		}
	})

	t.Run("plan without probes succeeds", func(t *testing.T) {
		t.Parallel()
		m := newMachine(t)
		p := &rplan.Plan{
			OneTimeInstructions: []rplan.OneTimeInstruction{sh("hello", "echo hello", true)},
			PeriodicInstructions: []rplan.PeriodicInstruction{{
				CommonInstruction: rplan.CommonInstruction{Name: "tick", Command: "sh", Args: []string{"-c", "echo tock"}},
				PeriodSeconds:     1,
			}},
		}
		if st := m.assign(p, "writer-a", 1, 1); st.State != statePending {
			t.Fatalf("a fresh assignment is pending, got %q", st.State)
		}
		st := m.reconcile(p, "writer-a", 1, 1, settled)
		if !st.success() {
			t.Fatalf("Status reports state %q probesPassed %v, not success: %s", st.State, st.ProbesPassed, describe(st.Secret))
		}
		if string(st.Secret.Data[keyAppliedPlan]) != string(st.Secret.Data[keyPlan]) {
			t.Errorf("the plan-secret controller did not copy the plan to appliedPlan: applied-checksum %q", st.Secret.Data["applied-checksum"])
		}
		s := m.wait("the periodic output", func(s *corev1.Secret) bool { return len(s.Data["applied-periodic-output"]) > 0 })
		out, err := decodeOneTimeOutput(s.Data["applied-output"])
		if err != nil || string(out["hello"]) != "hello\n" {
			t.Errorf("applied-output: %q %v", out, err)
		}
		per, err := decodePeriodicOutput(s.Data["applied-periodic-output"])
		if err != nil || string(per["tick"].Stdout) != "tock\n" || per["tick"].Name != "tick" || per["tick"].LastSuccessfulRunTime == "" {
			t.Errorf("applied-periodic-output: %+v %v", per, err)
		}
		if ps := string(s.Data[keyProbeStatuses]); ps != "{}" {
			t.Errorf("probe-statuses of a plan without probes = %q, want {}", ps)
		}
		if _, err := time.Parse(time.UnixDate, string(s.Data[keyLastApplyTime])); err != nil {
			t.Errorf("last-apply-time: %v", err)
		}
		annotationsAsRancherLeftThem(t, s, "writer-a", "1")
		checkAgentWrites(t, s)
	})

	t.Run("plan with probes succeeds once they pass", func(t *testing.T) {
		t.Parallel()
		var healthy atomic.Bool
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			if healthy.Load() {
				w.WriteHeader(http.StatusOK)
			} else {
				w.WriteHeader(http.StatusServiceUnavailable)
			}
		}))
		defer srv.Close()
		m := newMachine(t)
		p := &rplan.Plan{
			OneTimeInstructions: []rplan.OneTimeInstruction{sh("install", "true", false)},
			Probes:              map[string]rplan.Probe{"api": {HTTPGetAction: rplan.HTTPGetAction{URL: srv.URL + "/healthz"}, FailureThreshold: 1}},
		}
		m.assign(p, "writer-a", 1, 1)
		st := m.reconcile(p, "writer-a", 1, 1, func(st *planStatus) bool {
			return st.State == stateSucceeded && len(st.Secret.Data[keyProbeStatuses]) > 0 && string(st.Secret.Data[keyProbeStatuses]) != "{}"
		})
		if st.success() {
			t.Fatalf("Status reports success while the probe fails: %s", describe(st.Secret))
		}
		statuses, ok, err := parseProbeStatuses(st.Secret.Data[keyProbeStatuses])
		if err != nil || ok {
			t.Fatalf("probe-statuses while failing: %v healthy=%v err=%v", statuses, ok, err)
		}
		healthy.Store(true)
		st = m.reconcile(p, "writer-a", 1, 1, settled)
		if !st.success() {
			t.Fatalf("Status after the probe passes: state %q probesPassed %v: %s", st.State, st.ProbesPassed, describe(st.Secret))
		}
		statuses, ok, err = parseProbeStatuses(st.Secret.Data[keyProbeStatuses])
		if err != nil || !ok || !statuses["api"].Healthy || statuses["api"].SuccessCount < 1 {
			t.Errorf("probe-statuses once passing: %+v healthy=%v err=%v", statuses, ok, err)
		}
		if st.Secret.Annotations[annProbesPassed] == "" {
			t.Errorf("the plan-secret controller never stamped %s", annProbesPassed)
		}
		annotationsAsRancherLeftThem(t, st.Secret, "writer-a", "1")
		checkAgentWrites(t, st.Secret)
	})

	t.Run("failed plan is retried by Rancher after its cooldown", func(t *testing.T) {
		t.Parallel()
		m := newMachine(t)
		attempts := m.node.p("attempts")
		p := &rplan.Plan{OneTimeInstructions: []rplan.OneTimeInstruction{
			sh("fail", fmt.Sprintf("echo $CATTLE_AGENT_ATTEMPT_NUMBER >> %s; echo boom; exit 3", attempts), true),
		}}
		m.assign(p, "writer-a", 2, 2)
		st := m.reconcile(p, "writer-a", 2, 2, func(st *planStatus) bool { return st.State == stateFailed })
		if !st.Retrying || st.failure() {
			t.Fatalf("after the first failure Rancher must retry (attempt 1 of 2): retrying %v failure %v", st.Retrying, st.failure())
		}
		checkAgentWrites(t, st.Secret)
		out, err := decodeOneTimeOutput(st.Secret.Data["failed-output"])
		if err != nil || string(out["fail"]) != "boom\n" {
			t.Errorf("failed-output: %q %v", out, err)
		}
		// nodeplan's own key: the failing instruction, its outcome and last output lines.
		if f := string(st.Secret.Data["failed-instruction"]); !strings.Contains(f, `"name":"fail"`) ||
			!strings.Contains(f, `"outcome":"exit status 3"`) || !strings.Contains(f, `"lastLines":["boom"]`) {
			t.Errorf("failed-instruction: %s", f)
		}
		lastApply, err := time.Parse(time.UnixDate, string(st.Secret.Data[keyLastApplyTime]))
		if err != nil {
			t.Fatalf("last-apply-time: %v", err)
		}
		st = m.reconcile(p, "writer-a", 2, 2, func(st *planStatus) bool { return st.Secret.Annotations[annAttempt] == "2" })
		if since := time.Since(lastApply); since < retryCooldown {
			t.Errorf("retried %v after last-apply-time, before the %v cooldown", since, retryCooldown)
		}
		st = m.reconcile(p, "writer-a", 2, 2, func(st *planStatus) bool { return st.failure() })
		if st.State != stateFailed || st.Retrying {
			t.Fatalf("after attempt 2 of 2: state %q retrying %v", st.State, st.Retrying)
		}
		// The agent starts every pending plan as attempt 1 (docs/rancher-keys.md): Rancher's
		// attempt is its own count.
		if got := lines(t, attempts); strings.Join(got, ",") != "1,1" {
			t.Errorf("CATTLE_AGENT_ATTEMPT_NUMBER of the two runs: %v, want [1 1]", got)
		}
		annotationsAsRancherLeftThem(t, st.Secret, "writer-a", "2")
		checkAgentWrites(t, st.Secret)
	})

	t.Run("cancel a running plan", func(t *testing.T) {
		t.Parallel()
		m := newMachine(t)
		started, finished := m.node.p("started"), m.node.p("finished")
		p := &rplan.Plan{OneTimeInstructions: []rplan.OneTimeInstruction{
			sh("long", fmt.Sprintf("touch %s; sleep 60; touch %s", started, finished), false),
			sh("after", fmt.Sprintf("touch %s", finished), false),
		}}
		m.assign(p, "writer-a", 1, 1)
		m.waitFile(started)
		changed := false
		m.onFresh("CancelPlan", func(s *corev1.Secret) (err error) {
			changed, _, err = m.store.cancelPlan(s, "writer-a")
			return err
		})
		if !changed {
			t.Fatalf("CancelPlan of a running plan must write the annotation")
		}
		st := m.reconcile(p, "writer-a", 1, 1, func(st *planStatus) bool { return planState(st.Secret.Data[keyPlanState]).terminal() })
		if st.State != stateCanceled || !st.failure() {
			t.Fatalf("a canceled plan: state %q failure %v", st.State, st.failure())
		}
		c, err := decodeCheckpoint(st.Secret.Data[keyCheckpoint])
		if err != nil || c == nil {
			t.Fatalf("plan-checkpoint of a canceled plan: %v %v", c, err)
		}
		if c.Checksum != rplan.Checksum(st.Secret.Data[keyPlan]) || c.TotalInstructions != 2 || c.CompletedInstructions != 0 || c.Paused {
			t.Errorf("plan-checkpoint of a canceled plan: %+v", *c)
		}
		if _, err := os.Stat(finished); err == nil {
			t.Errorf("the canceled instruction ran on (or the next one ran)")
		}
		// Assigning the same content again by the same writer changes nothing: it stays canceled.
		writes := m.store.writes
		again := m.assign(p, "writer-a", 1, 1)
		if m.store.writes != writes || again.State != stateCanceled {
			t.Errorf("re-assigning a canceled plan: %d writes, state %q", m.store.writes-writes, again.State)
		}
		if changed, _, err := m.store.cancelPlan(again.Secret, "writer-a"); err != nil || changed {
			t.Errorf("a second CancelPlan must be a no-op: changed %v err %v", changed, err)
		}
		annotationsAsRancherLeftThem(t, st.Secret, "writer-a", "1")
		checkAgentWrites(t, st.Secret)
	})

	pauseScenario := func(t *testing.T, clearCheckpoint bool) {
		m := newMachine(t)
		runs1, started, gate, runs2 := m.node.p("runs1"), m.node.p("started"), m.node.p("gate"), m.node.p("runs2")
		p := &rplan.Plan{OneTimeInstructions: []rplan.OneTimeInstruction{
			sh("first", fmt.Sprintf("echo x >> %s; touch %s; while [ ! -e %s ]; do sleep 0.05; done", runs1, started, gate), false),
			sh("second", fmt.Sprintf("echo $CATTLE_AGENT_ATTEMPT_NUMBER >> %s", runs2), false),
		}}
		m.assign(p, "writer-a", 1, 1)
		m.waitFile(started)
		m.syncOperation(true, false)
		// Once the agent has seen the pause, the running instruction completes, and the agent
		// holds the plan before the next one.
		m.node.waitLog(t, "pause requested")
		if err := os.WriteFile(gate, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		s := m.wait("plan-state paused", func(s *corev1.Secret) bool { return planState(s.Data[keyPlanState]) == statePaused })
		c, err := decodeCheckpoint(s.Data[keyCheckpoint])
		if err != nil || c == nil || !c.Paused || c.CompletedInstructions != 1 || c.TotalInstructions != 2 || c.Checksum != rplan.Checksum(s.Data[keyPlan]) {
			t.Fatalf("plan-checkpoint of the paused plan: %+v %v", c, err)
		}
		if st, err := status(s); err != nil || st.failure() || st.success() {
			t.Errorf("a paused plan is waiting for Rancher: %+v %v", st, err)
		}
		if got := lines(t, runs2); len(got) != 0 {
			t.Errorf("the second instruction ran while paused")
		}
		checkAgentWrites(t, s)
		wantRuns1 := 1
		if clearCheckpoint {
			// A new writer assigns the same content afresh: the checkpoint is cleared with an
			// empty value, so the agent must not resume part-way through.
			st := m.assign(p, "writer-b", 1, 1)
			if v, ok := st.Secret.Data[keyCheckpoint]; !ok || len(v) != 0 {
				t.Fatalf("AssignPlan clears the checkpoint with an empty value: %q %v", v, ok)
			}
			wantRuns1 = 2
		}
		writer := map[bool]string{false: "writer-a", true: "writer-b"}[clearCheckpoint]
		m.syncOperation(false, false)
		if _, ok := m.get().Annotations[annPaused]; ok {
			t.Fatalf("resume removes %s", annPaused)
		}
		st := m.reconcile(p, writer, 1, 1, settled)
		if !st.success() {
			t.Fatalf("after resume: state %q probesPassed %v: %s", st.State, st.ProbesPassed, describe(st.Secret))
		}
		if got := lines(t, runs1); len(got) != wantRuns1 {
			t.Errorf("first instruction ran %d times, want %d", len(got), wantRuns1)
		}
		// Resumed (or, after the new writer, begun) with no failure behind it: attempt 1.
		if got := lines(t, runs2); strings.Join(got, ",") != "1" {
			t.Errorf("second instruction's runs (their CATTLE_AGENT_ATTEMPT_NUMBER): %v, want [1]", got)
		}
		if v, ok := st.Secret.Data[keyCheckpoint]; !ok || len(v) != 0 {
			t.Errorf("a completed plan's checkpoint is cleared with an empty value, not deleted: present %v value %q", ok, v)
		}
		annotationsAsRancherLeftThem(t, st.Secret, writer, "1")
		checkAgentWrites(t, st.Secret)
	}
	t.Run("pause then resume completes", func(t *testing.T) {
		t.Parallel()
		pauseScenario(t, false)
	})
	t.Run("checkpoint cleared by an empty value runs from the start", func(t *testing.T) {
		t.Parallel()
		pauseScenario(t, true)
	})

	t.Run("operations cancel of a paused plan", func(t *testing.T) {
		t.Parallel()
		m := newMachine(t)
		started, gate, runs2 := m.node.p("started"), m.node.p("gate"), m.node.p("runs2")
		p := &rplan.Plan{OneTimeInstructions: []rplan.OneTimeInstruction{
			sh("first", fmt.Sprintf("touch %s; while [ ! -e %s ]; do sleep 0.05; done", started, gate), false),
			sh("second", fmt.Sprintf("echo y >> %s", runs2), false),
		}}
		m.assign(p, "writer-a", 1, 1)
		m.waitFile(started)
		m.syncOperation(true, false)
		m.node.waitLog(t, "pause requested")
		if err := os.WriteFile(gate, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		m.wait("plan-state paused", func(s *corev1.Secret) bool { return planState(s.Data[keyPlanState]) == statePaused })
		// The Operation is canceled: one write sets the cancel and clears the pause. Rancher
		// confirms the cancel once plan-state is terminal.
		m.syncOperation(false, true)
		s := m.wait("a terminal plan-state", func(s *corev1.Secret) bool { return planState(s.Data[keyPlanState]).terminal() })
		st, err := status(s)
		if err != nil || st.State != stateCanceled || !st.failure() {
			t.Fatalf("a paused plan canceled by its Operation: %+v %v", st, err)
		}
		c, err := decodeCheckpoint(s.Data[keyCheckpoint])
		if err != nil || c == nil || c.Paused || c.CompletedInstructions != 1 || c.TotalInstructions != 2 || c.Checksum != rplan.Checksum(s.Data[keyPlan]) {
			t.Errorf("plan-checkpoint of the canceled plan: %+v %v", c, err)
		}
		if got := lines(t, runs2); len(got) != 0 {
			t.Errorf("the second instruction ran after the cancel")
		}
		annotationsAsRancherLeftThem(t, s, "writer-a", "1")
		checkAgentWrites(t, s)
	})

	t.Run("cancel of a succeeded plan stops its periodic instructions; a failed plan stays failed", func(t *testing.T) {
		t.Parallel()
		m := newMachine(t)
		ticks := m.node.p("ticks")
		p := &rplan.Plan{
			OneTimeInstructions: []rplan.OneTimeInstruction{sh("once", "true", false)},
			PeriodicInstructions: []rplan.PeriodicInstruction{{
				CommonInstruction: rplan.CommonInstruction{Name: "tick", Command: "sh", Args: []string{"-c", "echo t >> " + ticks}},
				PeriodSeconds:     1,
			}},
		}
		m.assign(p, "writer-a", 1, 1)
		if st := m.reconcile(p, "writer-a", 1, 1, settled); !st.success() {
			t.Fatalf("state %q", st.State)
		}
		m.onFresh("CancelPlan", func(s *corev1.Secret) error { _, _, err := m.store.cancelPlan(s, "writer-a"); return err })
		s := m.wait("canceled", func(s *corev1.Secret) bool { return planState(s.Data[keyPlanState]) == stateCanceled })
		if st, err := status(s); err != nil || !st.failure() {
			t.Errorf("a canceled plan is a failure to Rancher: %+v %v", st, err)
		}
		before := len(lines(t, ticks))
		// A bounded window to show the periodic instruction is not run again (one run in flight
		// at the cancel may still end).
		time.Sleep(3 * time.Second)
		if after := len(lines(t, ticks)); after > before+1 {
			t.Errorf("the periodic instruction ran %d more times after the cancel", after-before)
		}
		checkAgentWrites(t, s)

		// A failed plan is write-once: Rancher's cancel leaves it failed.
		f := newMachine(t)
		fp := &rplan.Plan{OneTimeInstructions: []rplan.OneTimeInstruction{sh("fail", "exit 1", false)}}
		f.assign(fp, "writer-a", 1, 1)
		if st := f.reconcile(fp, "writer-a", 1, 1, settled); st.State != stateFailed || !st.failure() {
			t.Fatalf("state %q failure %v", st.State, st.failure())
		}
		f.onFresh("CancelPlan", func(s *corev1.Secret) error { _, _, err := f.store.cancelPlan(s, "writer-a"); return err })
		// A bounded window to show the agent records nothing (it logs nothing for a plan not running).
		time.Sleep(2 * time.Second)
		fs := f.get()
		if st, err := status(fs); err != nil || st.State != stateFailed || !st.failure() {
			t.Errorf("a failed plan canceled afterwards: %+v %v", st, err)
		}
		checkAgentWrites(t, fs)
	})

	t.Run("reassign: same writer does nothing, a new writer reruns", func(t *testing.T) {
		t.Parallel()
		m := newMachine(t)
		runs := m.node.p("runs")
		p := &rplan.Plan{OneTimeInstructions: []rplan.OneTimeInstruction{sh("run", fmt.Sprintf("echo r >> %s", runs), false)}}
		m.assign(p, "writer-a", 1, 1)
		first := m.reconcile(p, "writer-a", 1, 1, settled)
		if !first.success() {
			t.Fatalf("first assignment: state %q", first.State)
		}
		// What the agent writes after the outcome (probe statuses) settles first.
		s := m.wait("probe-statuses", func(s *corev1.Secret) bool { return string(s.Data[keyProbeStatuses]) == "{}" })
		writes := m.store.writes
		if same := m.assign(p, "writer-a", 1, 1); m.store.writes != writes || same.State != stateSucceeded {
			t.Errorf("re-assigning the same content by the same writer: %d writes, state %q", m.store.writes-writes, same.State)
		}
		// A bounded window to show nothing happens: no second run, no new revision.
		time.Sleep(3 * time.Second)
		if got := lines(t, runs); len(got) != 1 {
			t.Errorf("same writer, same content: the plan ran %d times", len(got))
		}
		if rev := string(m.get().Data["plan-revision"]); rev != string(s.Data["plan-revision"]) {
			t.Errorf("plan-revision moved from %q to %q without a new assignment", s.Data["plan-revision"], rev)
		}
		fresh := m.assign(p, "writer-b", 1, 1)
		if fresh.State != statePending || fresh.Secret.Annotations[annAttempt] != "1" {
			t.Fatalf("a new writer assigns afresh: %+v", fresh)
		}
		st := m.reconcile(p, "writer-b", 1, 1, settled)
		if !st.success() {
			t.Fatalf("after the new writer: state %q", st.State)
		}
		if got := lines(t, runs); len(got) != 2 {
			t.Errorf("a new writer must rerun the plan: ran %d times", len(got))
		}
		annotationsAsRancherLeftThem(t, st.Secret, "writer-b", "1")
		checkAgentWrites(t, st.Secret)
	})
}
