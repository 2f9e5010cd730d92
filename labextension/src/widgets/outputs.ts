/**
 * The generations of one prompt, one column per adapter, side by side (overmind_jupyter/widgets/gate.py
 * `Outputs`, in the adapter panel).
 */

import { Child, h } from '../dom';
import type { IModel, IRenderProps, IWidgetModule } from './anywidget';
import { live } from './live';
import './outputs.css';

interface IOutput {
  adapter: string;
  status: 'running' | 'done' | 'error';
  text: string;
  ids?: number[];
  tokens: number;
  seconds: number;
}

function column(o: IOutput): HTMLElement {
  const said =
    o.status === 'running' ? 'running...' : o.status === 'done' ? `${o.tokens} tokens, ${o.seconds.toFixed(2)} s` : 'failed';
  const empty = o.status === 'done' && !o.text.trim() && o.ids && o.ids.length;
  return h(
    'div',
    {
      class: `om-out om-out-${o.status}`,
      'data-testid': 'overmind-widget-output',
      'data-adapter': o.adapter,
      'data-status': o.status
    },
    h('div', { class: 'om-head' }, h('span', { class: 'om-title' }, o.adapter), h('span', { class: 'om-muted' }, said)),
    empty
      ? h(
          'div',
          { class: 'om-text om-muted', 'data-testid': 'overmind-widget-ids' },
          `decodes to nothing; token ids: ${(o.ids ?? []).join(' ')}`
        )
      : h('div', { class: 'om-text' }, o.text)
  );
}

function draw(model: IModel, root: HTMLElement): void {
  const outputs: IOutput[] = model.get('outputs') || [];
  const notice: Child = model.get('notice')
    ? h('div', { class: 'om-notice', 'data-testid': 'overmind-widget-outputs-notice' }, model.get('notice'))
    : null;
  const parts: Child[] = [notice];
  if (outputs.length) {
    parts.push(
      h('div', { class: 'om-muted' }, 'prompt: ', h('span', { class: 'om-mono' }, model.get('prompt'))),
      h('div', { class: 'om-grid' }, ...outputs.map(column))
    );
  }
  root.replaceChildren(...(parts.filter(Boolean) as Node[]));
}

const widget: IWidgetModule = {
  render({ model, el }: IRenderProps) {
    const root = h('div', { class: 'om-w om-outputs', 'data-testid': 'overmind-widget-outputs' });
    el.append(root);
    return live(model, el, ['outputs', 'prompt', 'notice'], () => draw(model, root));
  }
};

export default widget;
