package conformance

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// node is one machine: a temp dir holding the agent's connection-info file and config (both
// 0600, as tests/common/mod.rs's ClusterNode writes them) and its directories, and the agent
// process started from them (`nodeplan agent --config`, remote mode), stopped by pid at cleanup.
type node struct {
	dir    string
	config string
	agent  *exec.Cmd
	log    string
}

func newNode(t *testing.T, cp *controlPlane, namespace, secret string) *node {
	t.Helper()
	dir := t.TempDir()
	conn, err := json.Marshal(map[string]string{"kubeConfig": cp.kubeconfig(), "namespace": namespace, "secretName": secret})
	if err != nil {
		t.Fatal(err)
	}
	config := fmt.Sprintf("remoteEnabled: true\nconnectionInfoFile: %[1]s/conn.json\nworkDirectory: %[1]s/work\n"+
		"appliedPlanDirectory: %[1]s/applied\ninterlockDirectory: %[1]s/interlock\npidDirectory: %[1]s/pids\n"+
		"nodePlanStateDirectory: %[1]s/nodeplans\nstopTimeout: 1s\nkillTimeout: 5s\n", dir)
	for name, body := range map[string][]byte{"conn.json": conn, "config.yaml": []byte(config)} {
		if err := os.WriteFile(filepath.Join(dir, name), body, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return &node{dir: dir, config: filepath.Join(dir, "config.yaml"), log: filepath.Join(dir, "agent.log")}
}

func (n *node) p(name string) string { return filepath.Join(n.dir, name) }

// waitLog waits (bounded by guard) until the agent's log has a line containing needle: the
// handshake that the agent has seen a request, where the Secret shows nothing yet.
func (n *node) waitLog(t *testing.T, needle string) {
	t.Helper()
	deadline := time.Now().Add(guard)
	for {
		b, _ := os.ReadFile(n.log)
		if strings.Contains(string(b), needle) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent never logged %q:\n%s", needle, tail(b, 40))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// start runs the agent; it is stopped (SIGTERM, then SIGKILL of its process group after 10 s) and
// its log shown on failure at cleanup.
func (n *node) start(t *testing.T) {
	t.Helper()
	log, err := os.OpenFile(n.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(agentBin, "agent", "--config", n.config)
	cmd.Env = append(os.Environ(), "NODEPLAN_LOG=info")
	cmd.Stdout, cmd.Stderr = log, log
	// Its own process group, so that what it started goes with it at the end.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		log.Close()
		t.Fatalf("start %s: %v", agentBin, err)
	}
	log.Close()
	watchdog(cmd.Process.Pid)
	n.agent = cmd
	done := make(chan struct{})
	go func() { _, _ = cmd.Process.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
		}
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-done
		if t.Failed() {
			b, _ := os.ReadFile(n.log)
			t.Logf("--- agent log (tail) ---\n%s", tail(b, 60))
		}
	})
}
