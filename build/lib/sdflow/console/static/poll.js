// A poller that never stacks calls: the next tick is scheduled only after the previous one
// has finished. tick() returns the delay (ms) before the next call.

export class Poller {
  constructor(tick, errorDelayMs = 3000) {
    this.tick = tick;
    this.errorDelayMs = errorDelayMs;
    this.timer = null;
    this.running = false;
    this.stopped = true;
    this.again = false;
  }

  start() {
    this.stopped = false;
    this.run();
    return this;
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    this.timer = null;
  }

  /** Poll now (or right after the call in flight ends). */
  now() {
    if (this.stopped) return;
    if (this.running) { this.again = true; return; }
    clearTimeout(this.timer);
    this.run();
  }

  async run() {
    if (this.stopped || this.running) return;
    this.timer = null;
    this.running = true;
    let delay = this.errorDelayMs;
    try {
      const next = await this.tick();
      if (typeof next === "number" && Number.isFinite(next)) delay = next;
    } catch (_err) {
      delay = this.errorDelayMs; // tick reports its own errors; never let one escape
    } finally {
      this.running = false;
    }
    if (this.stopped) return;
    if (this.again) { this.again = false; delay = 0; }
    this.timer = setTimeout(() => this.run(), Math.max(0, delay));
  }
}
