// The microphone's first channel as little-endian PCM16, posted to the page in
// chunks of `processorOptions.chunk` samples (at the AudioContext's rate).
class PCM16Chunks extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.chunk = options.processorOptions.chunk;
    this.buffer = new Int16Array(this.chunk);
    this.n = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    for (let i = 0; i < channel.length; i++) {
      const s = Math.max(-1, Math.min(1, channel[i]));
      this.buffer[this.n++] = s < 0 ? s * 32768 : s * 32767;
      if (this.n === this.chunk) {
        this.port.postMessage(this.buffer.buffer, [this.buffer.buffer]);
        this.buffer = new Int16Array(this.chunk);
        this.n = 0;
      }
    }
    return true;
  }
}

registerProcessor("pcm16", PCM16Chunks);
